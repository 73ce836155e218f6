"""A pause per business object: no second effect on an object while an earlier one is not known.

An action may declare the object it touches (``object: "order:{order_id}"`` in the actions file). The
template is rendered at submit and stored (``operations.object_key``). While an operation on that
object may have taken effect without our knowing it (in flight, outcome unknown, accepted and not
finished, with a person) or waits for a person's approval, a new operation on the same object is not
sent: it waits (``when_object_busy: wait``, the default) or is refused at submit (``refuse``). Other
objects flow. No refund is sent against an order whose previous refund we do not yet know about.

Not a lock per object for every call (Restate's virtual objects serialize every call per key): an
object is held only while its holder's outcome is unknown. How it is made safe under concurrency:

- **the hold** (``outbox_object_holds``, one row per object): the last operation let through to send.
  Right before a send, in its own committed transaction, an operation takes the hold: it creates the
  row, or locks it (FOR UPDATE; SQLite's one writer) and takes it over only if the holder's outcome is
  known now (read after the lock: a fresh snapshot). Every send on an object passes through that one
  row, so two workers can never both be let through while one of them is in doubt.
- **approvals**: an operation submitted earlier on the same object and awaiting a person's approval
  holds the later ones back (nothing of it was sent: it cannot be in doubt, but the person decides
  on the object as it stands).

The waiting operation is sent back to not_dispatched (``waiting_for = object``, its attempt not
counted), and looked at again after a wait that grows with how long it has waited (``RECHECK_S``, by
the blocker's state). Its deadline still applies. A refusal at submit sees only what is committed then: two intents submitted together
on a free object are both accepted, and the hold lets one send at a time.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.envelope import dumps_canonical
from outbox.ledger.models import Operation, core_table
from outbox.ledger.scope_models import ObjectHold
from outbox.ledger.states import Status

_OP = core_table(Operation)
_HOLD = core_table(ObjectHold)
MAX_OBJECT_KEY = 255

# A holder in one of these may have taken effect, or may still: the object is not free.
IN_DOUBT: frozenset[Status] = frozenset(
    {Status.DISPATCHING, Status.OUTCOME_UNKNOWN, Status.ACCEPTED, Status.RECONCILIATION_REQUIRED}
)
# What a refusal at submit looks for on the object (any operation, held or not).
BUSY: frozenset[Status] = IN_DOUBT | {Status.AWAITING_APPROVAL}

# How soon a waiting operation looks again, by what it waits behind: (first, at most). A call in flight
# ends in seconds; a lookup or the provider's processing in tens of seconds; a person in minutes or
# hours. Past the first, a tenth of the time waited so far (each look is a claim and an attempt row):
# a wait of an hour behind a person looks every 5 minutes, a day's wait costs ~300 looks.
RECHECK_S: dict[Status, tuple[float, float]] = {
    Status.DISPATCHING: (1.0, 1.0),
    Status.OUTCOME_UNKNOWN: (5.0, 60.0),
    Status.ACCEPTED: (5.0, 60.0),
    Status.RECONCILIATION_REQUIRED: (30.0, 300.0),
    Status.AWAITING_APPROVAL: (30.0, 300.0),
}

_PHRASE: dict[Status, str] = {
    Status.DISPATCHING: "being sent right now",
    Status.OUTCOME_UNKNOWN: "outcome unknown (being checked with the provider)",
    Status.ACCEPTED: "accepted by the provider and not finished",
    Status.RECONCILIATION_REQUIRED: "with a person, who decides whether it happened",
    Status.AWAITING_APPROVAL: "waiting for a person's approval",
}


@dataclass(frozen=True)
class ObjectRule:
    """An action's ``object`` template and what a busy object does to a new intent."""

    template: str
    busy: Literal["wait", "refuse"] = "wait"

    def fields(self) -> set[str]:
        return template_fields(self.template)

    def render(self, args: Mapping[str, Any]) -> str:
        """The object key of an intent with these (canonical) arguments; InvalidIntent names a missing one."""
        values: dict[str, str] = {}
        for name in self.fields():
            value = args.get(name)
            if value is None or value == "":
                raise InvalidIntent(
                    f"args.{name}", f"required: it names the business object this action touches ({self.template})"
                )
            values[name] = value if isinstance(value, str) else dumps_canonical(value).strip('"')
        key = self.template.format(**values)
        if len(key) > MAX_OBJECT_KEY:
            key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
        return key


def template_fields(template: str) -> set[str]:
    """The argument names of an ``object`` template; ValueError if it is malformed or names none."""
    names: set[str] = set()
    for _, field, spec, conv in string.Formatter().parse(template):
        if field is None:
            continue
        if not field.isidentifier() or spec or conv:
            raise ValueError(f"placeholder {{{field}}} must be a plain top-level argument name")
        names.add(field)
    if not names:
        raise ValueError(
            f"{template!r} names no argument: every intent would be one object (e.g. 'order:{{order_id}}')"
        )
    return names


@dataclass(frozen=True)
class Blocker:
    """The operation that holds an object back."""

    operation_id: str
    action: str
    status: Status
    object_key: str

    def recheck_s(self, waited_s: float = 0.0) -> float:
        """How long the waiting operation waits before it looks again, having waited ``waited_s``."""
        first, most = RECHECK_S.get(self.status, (5.0, 60.0))
        return min(max(first, waited_s / 10.0), most)

    def describe(self) -> str:
        return f"operation {self.operation_id} ({self.action}) on {self.object_key} is {_PHRASE.get(self.status, self.status.value)}"

    def as_dict(self) -> dict[str, str]:
        return {
            "operation_id": self.operation_id,
            "action": self.action,
            "status": self.status.value,
            "object": self.object_key,
        }


def busy_at_submit(session: Session, *, tenant: str, object_key: str, idempotency_key: str) -> Blocker | None:
    """An operation on the object (not this intent's own, by key) that is in doubt or awaits approval."""
    row = session.execute(
        select(_OP.c.id, _OP.c.action, _OP.c.status)
        .where(
            _OP.c.tenant == tenant,
            _OP.c.object_key == object_key,
            _OP.c.idempotency_key != idempotency_key,
            _OP.c.status.in_([s.value for s in BUSY]),
        )
        .order_by(_OP.c.created_at)
        .limit(1)
    ).first()
    return None if row is None else Blocker(row.id, row.action, Status(row.status), object_key)


def take_hold(session: Session, operation_id: str) -> Blocker | None:
    """Right before a send: let ``operation_id`` through on its object (None), or name what holds it
    back. The caller commits before sending, so the next operation on the object sees the hold.
    Operations without an object pass at once."""
    me = session.execute(
        select(_OP.c.tenant, _OP.c.object_key, _OP.c.created_at).where(_OP.c.id == operation_id)
    ).first()
    if me is None or me.object_key is None:
        return None
    tenant, key = me.tenant, me.object_key
    earlier = session.execute(
        select(_OP.c.id, _OP.c.action)
        .where(
            _OP.c.tenant == tenant,
            _OP.c.object_key == key,
            _OP.c.status == Status.AWAITING_APPROVAL.value,
            _OP.c.id != operation_id,
            or_(_OP.c.created_at < me.created_at, and_(_OP.c.created_at == me.created_at, _OP.c.id < operation_id)),
        )
        .order_by(_OP.c.created_at)
        .limit(1)
    ).first()
    if earlier is not None:
        return Blocker(earlier.id, earlier.action, Status.AWAITING_APPROVAL, key)
    taken = session.execute(
        driver_for(session)
        .upsert(_HOLD)
        .values(tenant=tenant, object_key=key, operation_id=operation_id, taken_at=db_now())
        .on_conflict_do_nothing(index_elements=[_HOLD.c.tenant, _HOLD.c.object_key])
        .returning(_HOLD.c.operation_id)
    ).first()
    if taken is not None:
        return None
    here = (_HOLD.c.tenant == tenant) & (_HOLD.c.object_key == key)
    holder = session.execute(select(_HOLD.c.operation_id).where(here).with_for_update()).scalar_one_or_none()
    if holder is None:  # released meanwhile (retention drops the holds of finished holders): take it anew
        return take_hold(session, operation_id)
    if holder != operation_id:
        # Read after the lock, in a statement of its own: the holder's state as committed now.
        state = session.execute(select(_OP.c.action, _OP.c.status).where(_OP.c.id == holder)).first()
        if state is not None and Status(state.status) in IN_DOUBT:
            return Blocker(holder, state.action, Status(state.status), key)
    session.execute(update(_HOLD).where(here).values(operation_id=operation_id, taken_at=db_now()))
    return None


def release_finished(session: Session, operation_ids: Sequence[str]) -> int:
    """Drop the holds of these (terminal) operations: a hold whose holder's outcome is known holds
    nothing, so dropping it changes no answer (retention, outbox/privacy/retention.py)."""
    if not operation_ids:
        return 0
    done = session.execute(delete(_HOLD).where(_HOLD.c.operation_id.in_(list(operation_ids))))
    return int(done.rowcount or 0)  # type: ignore[attr-defined]
