"""Claims: a worker takes a due operation under a lease and a fresh fencing token.

A claim bumps the token, sets ``dispatching`` with a lease from the database clock, counts the
attempt, opens the attempt row and records the event, all in the caller's transaction; the
previous owner's token now matches no row. How is the driver's business (outbox/ledger/drivers/): one
statement with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so concurrent workers never wait for each
other; a guarded UPDATE and its rows on SQLite, one writer at a time.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from outbox.ledger import tracing
from outbox.ledger.clock import LedgerClock, as_utc, db_now
from outbox.ledger.drivers import ClaimedRow, driver_for
from outbox.ledger.fairness import Fairness
from outbox.ledger.models import Operation, core_table
from outbox.ledger.request_record import RequestRecord, left_versions
from outbox.ledger.states import RECONCILE_CLAIMABLE, AttemptKind, Status, check_allowed

_OP = core_table(Operation)
# The process's terms when a caller passes none: tenants in turn, every weight 1, one cursor.
DEFAULT_FAIRNESS = Fairness()


# The moves a claim makes (in the drivers' one statement); the state table must list them.
check_allowed("*", [Status.NOT_DISPATCHED], Status.DISPATCHING)
for _status in RECONCILE_CLAIMABLE:
    check_allowed("*", [_status], _status)


@dataclass(frozen=True)
class Claim:
    """What a worker holds while its lease lasts: enough to call the downstream and finalize."""

    operation_id: str
    fencing_token: int
    attempt_id: int
    attempt_number: int  # row sequence of this kind: dispatch attempt n, or lookup n
    kind: AttemptKind  # dispatch (a worker will send the request) or lookup (the reconciler asks)
    tenant: str
    idempotency_key: str
    action: str
    args: str  # canonical JSON text; "" once purged (outbox/privacy/retention.py)
    args_digest: str
    subject: str
    worker: str
    lease_expires_at: dt.datetime
    max_attempts: int | None  # None: the action's budget decides
    attempt_count: int  # budget-counted dispatch attempts so far, this one included (refunds excluded)
    deadline_at: dt.datetime | None
    created_at: dt.datetime
    cancel_requested: bool
    # An earlier attempt may have taken effect (ambiguous or never reported, and not proven unable
    # to land), or did (a confirmed success on record, even a stale worker's): this operation must
    # not end failed_before_commit or cancelled (effect_guard.py).
    open_ambiguity: bool
    # Dispatch attempts up to this number were proven unable to take effect (a fenced lookup, the
    # provider's record, a person): before failing on budget, the reconciler looks once more.
    proven_absent_through: int = 0
    # The database's clock as of the claim: deadlines and windows are judged on it, never on this
    # worker's wall clock. None only for claims built by hand (tests): then the wall clock.
    clock: LedgerClock | None = None
    # The key the provider sees (outbox/ledger/provider_keys.py); "" (claims built by hand): the bare key.
    provider_key: str = ""
    # The status the claim holds it in: dispatching, or (a lookup) outcome_unknown / accepted.
    # A lookup is never held in dispatching: a lookup claim built by hand (tests) is outcome_unknown.
    status: Status = Status.DISPATCHING
    # The W3C trace context the intent was submitted in: every span of this claim's work continues it.
    traceparent: str | None = None
    # The action's version at submit (None: not known then), and the request on record under its key
    # (None: none left yet, or its worker died before recording it): outbox/ledger/request_record.py.
    action_version: str | None = None
    sent: RequestRecord | None = None
    # Nothing on record: the versions of the action the earlier dispatch attempts that may have
    # reached the provider were claimed under (None: not known); empty when none may have.
    left_under: frozenset[str | None] = frozenset()
    # Who submitted it (``key:<id>``; None: in-process): its authority is checked again before the send.
    submitted_by: str | None = None
    # The conversation it is charged to: each retry is charged there before it leaves (budget_charges.py).
    budget_scope: str | None = None

    def log_fields(self) -> dict[str, object]:
        """What a log line about this claim's work carries as fields (OUTBOX_LOG_FORMAT=json)."""
        kind = "lookup" if self.kind == AttemptKind.LOOKUP else "attempt"
        return {
            "operation_id": self.operation_id,
            "tenant": self.tenant,
            "action": self.action,
            "idempotency_key": self.idempotency_key,
            kind: self.attempt_number,
            "fencing_token": self.fencing_token,
        }

    def __post_init__(self) -> None:
        if not self.provider_key:
            object.__setattr__(self, "provider_key", self.idempotency_key)
        if self.kind == AttemptKind.LOOKUP and self.status is Status.DISPATCHING:
            object.__setattr__(self, "status", Status.OUTCOME_UNKNOWN)

    def now(self) -> dt.datetime:
        """The database's time now (as of the claim, plus the monotonic time since)."""
        return self.clock.now() if self.clock is not None else dt.datetime.now(dt.UTC)


def claim_due(
    session: Session,
    *,
    worker: str,
    lease_s: float,
    limit: int = 1,
    operation_id: str | None = None,
    operation_ids: Sequence[str] | None = None,
    also_due: int = 0,
    fairness: Fairness | None = None,
    versions: Mapping[str, str] | None = None,
) -> list[Claim]:
    """Claim up to ``limit`` due ``not_dispatched`` operations (only ``operation_id(s)`` if given).

    Whatever is due is shared among tenants (``fairness``, outbox/ledger/fairness.py; default:
    tenants in turn, weight 1, this process's cursor): each tenant's higher priorities first, then
    its oldest. ``also_due``: with ids given, the batch is ``limit + also_due`` and is filled with
    other due operations in the same statement (a doorbell's batch filled with whatever else is
    due); the given ids come first only within their own tenant, so another tenant's due row still
    gets its turn (a given id left out stays due for the next claim). Without ``also_due`` only
    the given ids are claimed. Fairness off: the highest priority, then the oldest, given ids first.

    ``versions``: the worker's version of each action (the actions file's, outbox/actions/versions.py),
    written on each attempt row opened: what its request is built under if none is on record
    (outbox/ledger/request_record.py). None (tests): not known.

    Returns the claims made in the order they were ranked; an empty list when nothing was due
    (another worker won, the operation is not due yet, or it is no longer ``not_dispatched``).
    """
    ids = _ids(operation_id, operation_ids)
    if also_due < 0:
        raise ValueError("also_due must be >= 0")
    return _claim(
        session,
        AttemptKind.DISPATCH,
        worker=worker,
        lease_s=lease_s,
        limit=limit,
        operation_ids=ids,
        also_due=also_due if ids is not None else 0,
        fairness=fairness or DEFAULT_FAIRNESS,
        versions=versions,
    )


def _ids(operation_id: str | None, operation_ids: Sequence[str] | None) -> list[str] | None:
    if operation_id is not None and operation_ids is not None:
        raise ValueError("pass operation_id or operation_ids, not both")
    if operation_id is not None:
        return [operation_id]
    return list(operation_ids) if operation_ids is not None else None


def claim_unknown(
    session: Session,
    *,
    worker: str,
    lease_s: float,
    limit: int = 1,
    operation_id: str | None = None,
    operation_ids: Sequence[str] | None = None,
    also_due: int = 0,
) -> list[Claim]:
    """The reconciler's claim: due ``outcome_unknown`` and ``accepted`` operations whose lease (if
    any) has expired (only ``operation_id(s)`` if given; up to ``limit``).

    ``also_due``: with ids given, also claim up to this many other due ones, oldest first, in the
    same statement (a reconcile doorbell's batch filled with whatever else waits for a lookup).
    The status stays as it was (nothing is re-sent); the token is bumped, a lease is taken
    and a ``lookup`` attempt row is opened for what the provider will say.
    """
    ids = _ids(operation_id, operation_ids)
    if also_due < 0:
        raise ValueError("also_due must be >= 0")
    return _claim(
        session,
        AttemptKind.LOOKUP,
        worker=worker,
        lease_s=lease_s,
        limit=limit,
        operation_ids=ids,
        also_due=also_due if ids is not None else 0,
    )


def _claim(
    session: Session,
    kind: AttemptKind,
    *,
    worker: str,
    lease_s: float,
    limit: int,
    operation_ids: list[str] | None,
    also_due: int = 0,
    fairness: Fairness | None = None,
    versions: Mapping[str, str] | None = None,
) -> list[Claim]:
    if limit < 1:
        raise ValueError("limit must be >= 1")
    after = fairness.after if fairness is not None else ""
    rows = driver_for(session).claim(
        session,
        kind,
        worker=worker,
        lease_s=lease_s,
        limit=limit,
        operation_ids=operation_ids,
        also_due=also_due,
        fairness=fairness,
        versions=versions,
    )
    if fairness is not None:
        fairness.advance(after, (row.tenant for row in rows))
    claims = [_claim_of(row, worker, kind) for row in rows]
    if tracing.enabled():  # each claim a (short) span of its intent's trace: its token and attempt
        for claim in claims:
            with tracing.span("outbox.claim", parent=claim.traceparent, attributes=tracing.attributes_of(claim)):
                pass
    return claims


def lookup_claim_of(row: ClaimedRow, worker: str) -> Claim:
    """A lookup claim of a row claimed elsewhere (a handoff's re-check: outbox/evidence/rechecks.py)."""
    return _claim_of(row, worker, AttemptKind.LOOKUP)


def _claim_of(row: ClaimedRow, worker: str, kind: AttemptKind) -> Claim:
    lease = as_utc(row.lease_expires_at)
    created = as_utc(row.created_at)
    claimed = as_utc(row.updated_at)
    assert lease is not None and created is not None and claimed is not None
    return Claim(
        operation_id=row.id,
        fencing_token=row.fencing_token,
        attempt_id=row.attempt_id,
        attempt_number=row.number,
        kind=kind,
        tenant=row.tenant,
        idempotency_key=row.idempotency_key,
        provider_key=row.provider_key or row.idempotency_key,
        action=row.action,
        args=row.args or "",  # "": purged (outbox/privacy/retention.py); dispatch refuses to send it
        args_digest=row.args_digest,
        subject=row.subject,
        worker=worker,
        lease_expires_at=lease,
        max_attempts=row.max_attempts,
        attempt_count=row.attempt_count,
        deadline_at=as_utc(row.deadline_at),
        created_at=created,
        cancel_requested=bool(row.cancel_requested),
        open_ambiguity=bool(row.open_ambiguity),
        proven_absent_through=int(row.proven_absent_through or 0),
        clock=LedgerClock(claimed),
        status=Status(row.status),
        traceparent=getattr(row, "traceparent", None),
        action_version=getattr(row, "action_version", None),
        sent=RequestRecord.of_row(row),
        left_under=left_versions(getattr(row, "left_versions", None)),
        submitted_by=getattr(row, "submitted_by", None),
        budget_scope=getattr(row, "budget_scope", None),
    )


def read_due(session: Any, operation_ids: Sequence[str]) -> Sequence[Any]:
    """Which of these not_dispatched operations are due now, with what a deadline check needs:
    (id, action, created_at, deadline_at, max_attempts, attempt_count, db_now). Nothing is locked."""
    return driver_for(session).read_due(session, operation_ids)


def extend_lease_if_fenced(session: Session, claim: Claim, *, lease_s: float) -> bool:
    """Renew the lease of a live claim; False when the token is no longer current."""
    stmt = (
        update(_OP)
        .where(
            _OP.c.id == claim.operation_id,
            _OP.c.status == claim.status.value,
            _OP.c.fencing_token == claim.fencing_token,
        )
        .values(lease_expires_at=db_now(lease_s), updated_at=db_now())
        .returning(_OP.c.id)
    )
    return session.execute(stmt).first() is not None
