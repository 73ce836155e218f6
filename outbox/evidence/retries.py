"""Retry as a new intent: a person turns a case into a new task, linked to the old one.

The old operation's key can name only its first request (outbox/ledger/request_record.py), and a
person may have no way to settle it under that key (the provider forgot the key, the request it
names cannot be sent again, nobody can tell whether it happened). They may then retry the intent as
a new operation: the same tenant, action, arguments and subject, under a derived key
(``<old key>:retry-1``, then ``:retry-2`` for a retry of that one; the provider's key derived the
same way), so the provider sees a new request, never the old key again.

That new request is a second effect if the old one took effect. So it is a person's act only (the
CLI, the operator API, the console; never automation), and only:

- when nothing confirmed an effect: a provider-confirmed success on any attempt refuses it (resolve
  it as succeeded);
- on proof that the old one did not take effect (no attempt can still land: every dispatch attempt
  proven absent by a fenced lookup, the provider's record or a person), or on the person's word,
  which the resolution is, with its required note. The history says which.

The old operation ends ``abandoned`` (nothing more is sent or looked up under its key; a late
confirmation still settles it, and the report then shows both effects); its handoff is resolved
``retry-as-new-intent``. An operation a person abandoned earlier can be retried the same way. The
two are linked both ways (``retried_as``, ``retry_of``). The new one is an intent like any other: the
action's approval rule, object and limits apply, and a stopped subject's is refused. It is submitted in
the name of the person who retried it (``submitted_by``: their identity, ``key:<id>`` or
``cli:<account>``), as a person's "not executed" is sent in theirs: the key that asked for the old one
may have been revoked since, and separation of duties keeps the person from approving it themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.evidence.handoffs import locked
from outbox.ledger.clock import db_now
from outbox.ledger.effect_guard import may_have_taken_effect
from outbox.ledger.envelope import loads_exact
from outbox.ledger.intent import MAX_KEY_LEN, Intent
from outbox.ledger.models import ATTEMPTS, OPERATIONS, Attempt, Handoff, Operation, core_table
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.states import AttemptClass, EventKind, HandoffStatus, Resolution, Status
from outbox.ledger.submit import Receipt, submit
from outbox.ledger.transitions import move
from outbox.ledger.writes import released

_OP = core_table(Operation)
_RETRY = re.compile(r"(?s)(.*):retry-(\d+)")


@dataclass(frozen=True)
class Retried:
    """What a retry as a new intent did: the old operation (now abandoned) and the new one."""

    old_operation_id: str
    new: Receipt
    proven: bool  # the old one was proven not to have taken effect (else: on the person's word)

    def as_dict(self) -> dict[str, object]:
        return {
            "operation_id": self.old_operation_id,
            "operation_status": Status.ABANDONED.value,
            "retried_as": self.new.operation_id,
            "new_idempotency_key": self.new.idempotency_key,
            "new_status": self.new.status,
            "proven_not_executed": self.proven,
        }


def derived_key(key: str, *, retry_of: str | None) -> str:
    """``key:retry-1``; a retry of a retry counts on (``key:retry-2``), not ``key:retry-1:retry-1``."""
    m = _RETRY.fullmatch(key) if retry_of is not None else None
    return f"{m[1]}:retry-{int(m[2]) + 1}" if m else f"{key}:retry-1"


def retry_as_new_intent(
    session: Session,
    handoff: Handoff,
    *,
    by: str,
    note: str,
    rules: SubmitRules | None,
    identity: str | None = None,
) -> Retried:
    """The module docstring, in the caller's transaction (it commits the old one's end, the new intent
    and both links together, or none of them)."""
    if not note or not note.strip():
        raise InvalidIntent(
            "--note", "required: why a new intent, and what you checked (you vouch that the old one did not happen)"
        )
    if not by or not by.strip():
        raise InvalidIntent("--by", "required: who retries it")
    handoff = locked(session, handoff)
    op = session.get(Operation, handoff.operation_id, populate_existing=True)
    assert op is not None
    abandoned = handoff.status == HandoffStatus.RESOLVED.value and handoff.resolution == Resolution.ABANDONED.value
    if handoff.status != HandoffStatus.OPEN.value and not abandoned:
        raise InvalidIntent(
            "ID", f"handoff {handoff.id} was resolved as {handoff.resolution}: only an open or abandoned one is retried"
        )
    source = Status(op.status)
    if source not in (Status.RECONCILIATION_REQUIRED, Status.ABANDONED):
        raise InvalidIntent("ID", f"operation {op.id} is {op.status}: nothing to retry")
    if op.retried_as is not None:
        raise InvalidIntent("ID", f"operation {op.id} was already retried as {op.retried_as}")
    if op.key_space != "intent":
        raise InvalidIntent("ID", f"operation {op.id} is a step of run {op.run_id}: resolve it in its run")
    if op.args is None:
        raise InvalidIntent(
            "ID", f"operation {op.id}'s arguments were purged (retention): submit a new intent yourself"
        )
    confirmed = session.execute(
        select(Attempt.kind, Attempt.attempt_number, Attempt.provider_reference)
        .where(Attempt.operation_id == op.id, Attempt.attempt_class == AttemptClass.SUCCEEDED.value)
        .limit(1)
    ).first()
    if confirmed is not None:
        raise InvalidIntent(
            "--as",
            f"the provider confirmed an effect on {confirmed.kind} attempt {confirmed.attempt_number} (reference "
            f"{confirmed.provider_reference}): resolve it --as succeeded, a new intent would be a second effect",
        )
    in_doubt = session.execute(
        text(
            f"SELECT EXISTS (SELECT 1 FROM {ATTEMPTS} a JOIN {OPERATIONS} o ON o.id = a.operation_id"
            f" WHERE o.id = :id AND {may_have_taken_effect('o')})"
        ),
        {"id": op.id},
    ).scalar()
    proven = not in_doubt
    key = derived_key(op.idempotency_key, retry_of=op.retry_of)
    provider_key = derived_key(op.provider_key or op.idempotency_key, retry_of=op.retry_of)
    if len(key) > MAX_KEY_LEN or len(provider_key) > 255:
        raise InvalidIntent(
            "ID", f"the derived key {key!r} is longer than {MAX_KEY_LEN} characters: submit a new intent"
        )
    who = by if identity is None or identity in by else f"{by} ({identity})"
    why = (
        "proven not executed (no attempt can still take effect)"
        if proven
        else "on the word of the person retrying it (an earlier attempt was never proven absent)"
    )
    said = f"retried as a new intent under key {key!r} by {who}, {why}: {note}"
    # Built (and so validated) before anything moves.
    intent = Intent(
        tenant=op.tenant,
        idempotency_key=key,
        action=op.action,
        args=loads_exact(op.args),
        subject=op.subject,
        run_id=op.run_id,
        tool_call_id=op.tool_call_id,
        max_attempts=op.max_attempts,
        provider_key=provider_key,
        submitted_by=identity or op.submitted_by,
        priority=op.priority,
    )
    # First the old one's end: its object is free for the new one, and a re-check in flight is fenced off.
    move(
        session,
        op.id,
        sources=[source],
        to=Status.ABANDONED,
        event=EventKind.RESOLVED_RETRY,
        actor=who,
        reason=said,
        fencing_token=_OP.c.fencing_token + 1,
        **released(),
    )
    new = submit(session, intent, rules=rules)
    if not new.new:
        raise InvalidIntent("ID", f"the derived key {key!r} already names operation {new.operation_id}")
    session.execute(update(_OP).where(_OP.c.id == op.id).values(retried_as=new.operation_id))
    session.execute(update(_OP).where(_OP.c.id == new.operation_id).values(retry_of=op.id))
    session.execute(
        update(Handoff)
        .where(Handoff.id == handoff.id)
        .values(
            status=HandoffStatus.RESOLVED.value,
            resolution=Resolution.RETRY_AS_NEW_INTENT.value,
            resolved_by=who,
            resolved_at=db_now(),
            note=f"{note} (retried as operation {new.operation_id}, key {key!r}; {why})",
            next_check_at=None,
        )
    )
    return Retried(op.id, new, proven)
