"""Re-checks: the ledger side of a handoff that keeps working.

An open handoff with a ``next_check_at`` (outbox/evidence/checks.py) is looked up again by the
reconciler, on the same lookup threads, breakers and limits as an outcome_unknown operation, but
through its own claim: a ``reconciliation_required`` row is not in the reconciler's queue
(``RECONCILE_CLAIMABLE``, the partial index ``ix_outbox_operations_unknown``), whose rows it settles
by its lookup budget; a case is settled by the provider's answer only, on a schedule of hours.

- ``claim_rechecks``: due cases whose operation no reconciler holds: the operation's token is
  bumped, a lease taken and a ``lookup`` attempt row opened, as ``claims.claim_unknown`` does; its
  status stays ``reconciliation_required``. The person's side moves the same row: a resolution
  changes its status (and an abandonment its token), so the re-check's write, guarded by status and
  token, is refused; a re-check that wrote first has changed the status, so the person's move is
  refused ("already resolved by the provider's evidence"). Never both.
- ``settle_found``: the provider holds the effect (succeeded) or holds the key as failed
  (failed_at_provider): the operation moves under the re-check's token and its handoff is closed
  "resolved by the provider's evidence", with the lookup's attempt row as the evidence.
- ``settle_open``: nothing that settles it (not found, still pending, the lookup down): the lookup
  row keeps the answer, the case stays with its person, and its next check is scheduled (or none,
  when the key retention is over or nothing more can be learnt).

A re-check moves only what a lookup proves. It never sends anything: a "not found" that proves
the absence (an authoritative lookup that fenced every earlier attempt off) is written down
(``proven_absent_through``) for the person, who may then resolve not-executed or retry it as a new
intent; it does not decide for them.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, and_, func, insert, or_, select, text, update
from sqlalchemy.orm import Session

from outbox.evidence.checks import RecheckTerms, next_check
from outbox.evidence.handoffs import close_by_evidence
from outbox.evidence.settlement import _last_dispatch_number
from outbox.evidence.sinks import EvidenceSink, record_for
from outbox.ledger.claims import Claim, lookup_claim_of
from outbox.ledger.clock import as_utc, db_now, db_scan_now
from outbox.ledger.drivers import ClaimedRow
from outbox.ledger.effect_guard import may_have_taken_effect, no_effect_confirmed
from outbox.ledger.events import record_events
from outbox.ledger.models import ATTEMPTS, OPERATIONS, Attempt, Handoff, Operation, core_table
from outbox.ledger.states import AttemptClass, AttemptKind, EventKind, HandoffStatus, Resolution, Status, check_allowed
from outbox.ledger.transitions import AttemptReport, mark_attempt_stale, record_attempt
from outbox.ledger.writes import released, success_values

_OP = core_table(Operation)
_AT = core_table(Attempt)
_H = core_table(Handoff)
RR = Status.RECONCILIATION_REQUIRED
# A claimed row's columns, in ClaimedRow's order (left_versions: a dispatch's only, None for a lookup).
_NOT_COLUMNS = ("attempt_id", "number", "open_ambiguity", "left_versions")
_CLAIMED = tuple(_OP.c[name] for name in ClaimedRow._fields if name not in _NOT_COLUMNS)

check_allowed("*", [RR], RR)  # the claim's move, written as one statement below


def _due() -> list[Any]:
    # The bound the partial index ix_outbox_handoffs_checks can answer (db_scan_now: clock.py says why):
    # a range of the cases due, not a read of every open case at each claim.
    now = db_scan_now()
    return [
        _H.c.status == HandoffStatus.OPEN.value,
        _H.c.next_check_at.is_not(None),
        _H.c.next_check_at <= now,
        _OP.c.status == RR.value,
        or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < now),
    ]


def due_rechecks(engine: Engine, *, limit: int) -> list[str]:
    """Operations whose handoff's next check is due and that no reconciler holds, oldest due first
    (the relay rings the reconciler for them; the partial index ``ix_outbox_handoffs_checks``)."""
    stmt = (
        select(_H.c.operation_id)
        .join(_OP, _OP.c.id == _H.c.operation_id)
        .where(*_due())
        .order_by(_H.c.next_check_at)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [str(op_id) for op_id in conn.execute(stmt).scalars()]


def claim_rechecks(
    session: Session, *, worker: str, lease_s: float, limit: int, operation_ids: Sequence[str] | None = None
) -> list[Claim]:
    """Claim up to ``limit`` due re-checks (only ``operation_ids`` if given), oldest due first: each a
    lookup claim whose status stays reconciliation_required (the module docstring)."""
    if limit < 1:
        return []
    due = (
        select(_OP.c.id)
        .join(_H, _H.c.operation_id == _OP.c.id)
        .where(*_due())
        .order_by(_H.c.next_check_at)
        .limit(limit)
    )
    if operation_ids is not None:
        due = due.where(_OP.c.id.in_(list(operation_ids)))
    # PostgreSQL: two reconcilers never take the same case (SQLite, one writer at a time, ignores it).
    due = due.with_for_update(of=_OP, skip_locked=True)
    chosen = list(session.execute(due).scalars())
    if not chosen:
        return []
    guard = [
        _OP.c.id.in_(chosen),
        _OP.c.status == RR.value,
        or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < db_now()),
    ]
    rows = session.execute(
        update(_OP)
        .where(*guard)
        .values(
            fencing_token=_OP.c.fencing_token + 1,
            lease_owner=worker,
            lease_expires_at=db_now(lease_s),
            updated_at=db_now(),
        )
        .returning(*_CLAIMED)
    ).all()
    order = {op_id: n for n, op_id in enumerate(chosen)}
    return [_open_lookup(session, row, worker) for row in sorted(rows, key=lambda r: order[r.id])]


def _open_lookup(session: Session, row: Any, worker: str) -> Claim:
    """The claim's lookup attempt row, numbered after the operation's last lookup, and its event."""
    open_ambiguity = session.execute(
        text(
            f"SELECT EXISTS (SELECT 1 FROM {ATTEMPTS} a WHERE a.operation_id = o.id AND {may_have_taken_effect('o')})"
            f" FROM {OPERATIONS} o WHERE o.id = :id"
        ),
        {"id": row.id},
    ).scalar_one()
    number = (
        1
        + session.execute(
            select(func.coalesce(func.max(_AT.c.attempt_number), 0)).where(
                _AT.c.operation_id == row.id, _AT.c.kind == AttemptKind.LOOKUP.value
            )
        ).scalar_one()
    )
    attempt_id = session.execute(
        insert(_AT)
        .values(
            operation_id=row.id,
            attempt_number=number,
            kind=AttemptKind.LOOKUP.value,
            fencing_token=row.fencing_token,
            worker=worker,
            started_at=db_now(),
            attempt_class=AttemptClass.PENDING.value,
            stale=False,
        )
        .returning(_AT.c.id)
    ).scalar_one()
    record_events(
        session,
        [(row.id, row.fencing_token)],
        from_status=RR,
        to=RR,
        kind=EventKind.RECONCILE_CLAIM,
        reason=f"lookup attempt {number} (a handoff's re-check)",
        actor=worker,
    )
    head, tail = tuple(row)[:18], tuple(row)[18:]
    claimed = ClaimedRow(*head, attempt_id, number, bool(open_ambiguity), *tail)  # type: ignore[call-arg]
    return lookup_claim_of(claimed, worker)


def _refused(session: Session, claim: Claim, wrote: bool) -> None:
    """The move matched no row: the case moved on (a person, a webhook) or another claim holds it."""
    if wrote:
        mark_attempt_stale(session, claim.attempt_id)


def settle_found(
    session: Session,
    claim: Claim,
    report: AttemptReport,
    *,
    to: Status,
    reason: str,
    sink: EvidenceSink,
    result: dict[str, Any] | None = None,
) -> Status | None:
    """What the provider holds settles the case: ``to`` succeeded (its evidence recorded: degraded when
    a separate evidence store is down) or failed_at_provider, under the re-check's token; its handoff is
    closed "resolved by the provider's evidence". Returns the status moved to, None when refused
    (the case moved on meanwhile: the lookup row keeps the answer, marked stale)."""
    if to not in (Status.SUCCEEDED, Status.FAILED_AT_PROVIDER):
        raise ValueError(f"a re-check settles to succeeded or failed_at_provider, not {to.value}")
    wrote = record_attempt(session, claim.attempt_id, report)
    values: dict[str, Any] = released()
    extra_where: list[Any] = []
    resolution = Resolution.FAILED_AT_PROVIDER
    record = None
    if to is Status.SUCCEEDED:
        op = session.get(Operation, claim.operation_id)
        assert op is not None
        record = record_for(session, op, reference=report.provider_reference, response_digest=report.response_digest)
        to = sink.write_separately(record) if sink.separate else Status.SUCCEEDED
        values.update(success_values(report.provider_reference, report.response_digest, result), error_class=None)
        resolution = Resolution.SUCCEEDED
    else:
        # The provider holds the key as failed: no attempt of it can still take effect there.
        values.update(proven_absent_through=_last_dispatch_number(claim.operation_id))
        extra_where.append(no_effect_confirmed(excluding_attempt=claim.attempt_id))
    said = f"resolved by the provider's evidence: {reason}"
    moved = session.execute(
        update(_OP)
        .where(
            _OP.c.id == claim.operation_id,
            _OP.c.status == RR.value,
            _OP.c.fencing_token == claim.fencing_token,
            *extra_where,
        )
        .values(
            status=to.value, reason=said, updated_at=db_now(), finished_at=_finished(to), waiting_for=None, **values
        )
        .returning(_OP.c.fencing_token)
    ).first()
    if moved is None:
        _refused(session, claim, wrote)
        return None
    check_allowed(claim.operation_id, [RR], to)
    record_events(
        session,
        [(claim.operation_id, int(moved.fencing_token))],
        from_status=RR,
        to=to,
        kind=EventKind.RESOLVED_BY_EVIDENCE,
        reason=report.event_reason(f"lookup {claim.attempt_number}", said),
        actor=claim.worker,
    )
    if record is not None and not sink.separate:
        sink.write(record, session=session)
    close_by_evidence(
        session,
        claim.operation_id,
        resolution=resolution,
        reference=report.provider_reference,
        actor=claim.worker,
        note=f"{said} (lookup {claim.attempt_number})",
        attempt_id=claim.attempt_id,
    )
    return to


def _finished(to: Status) -> Any:
    return db_now() if to in (Status.SUCCEEDED, Status.FAILED_AT_PROVIDER) else None


def settle_open(
    session: Session,
    claim: Claim,
    report: AttemptReport,
    *,
    reason: str,
    terms: RecheckTerms,
    rng: random.Random,
    proven_absent: bool = False,
    stop: str | None = None,
) -> tuple[bool, dt.datetime | None]:
    """Nothing that settles the case: the answer kept on the lookup row, the case left with its person
    and its next check scheduled (``stop``: none, and why). ``proven_absent``: the lookup proved that
    no dispatch attempt so far can take effect (written down, for the person's decision). Returns
    (moved: False when refused, the next check)."""
    wrote = record_attempt(session, claim.attempt_id, report)
    case = session.execute(
        select(_H.c.id, _H.c.opened_at, _H.c.checks_until, db_now()).where(
            _H.c.operation_id == claim.operation_id, _H.c.status == HandoffStatus.OPEN.value
        )
    ).first()
    at = None
    if case is not None and stop is None:
        now, opened, until = as_utc(case[3]), as_utc(case[1]), as_utc(case[2])
        assert now is not None and opened is not None
        at = next_check(now, opened, until, terms, rng)
        if at is None:
            stop = "the provider's key retention is over: a lookup by key proves nothing any more"
    values: dict[str, Any] = released()
    if proven_absent:
        values.update(proven_absent_through=_last_dispatch_number(claim.operation_id))
    when = f"next check at {at.isoformat(timespec='seconds')}" if at is not None else f"no more re-checks: {stop}"
    said = f"{reason}; {when}"
    # The operation's own reason stays the handoff's (why a person has it); the history and the
    # lookup row say what this re-check found.
    moved = session.execute(
        update(_OP)
        .where(_OP.c.id == claim.operation_id, _OP.c.status == RR.value, _OP.c.fencing_token == claim.fencing_token)
        .values(updated_at=db_now(), **values)
        .returning(_OP.c.fencing_token)
    ).first()
    if moved is None:
        _refused(session, claim, wrote)
        return False, None
    record_events(
        session,
        [(claim.operation_id, int(moved.fencing_token))],
        from_status=RR,
        to=RR,
        kind=EventKind.RECHECK,
        reason=report.event_reason(f"lookup {claim.attempt_number}", said),
        actor=claim.worker,
    )
    if case is not None:
        session.execute(update(_H).where(_H.c.id == case[0]).values(next_check_at=at))
    return True, at


def recheck_now(session: Session, operation_id: str) -> bool:
    """The provider said something of a case it settles (a webhook): its re-check is due now, and the
    lookup reads what the provider holds. False: no open handoff of it is re-checked."""
    found = session.execute(
        update(_H)
        .where(
            and_(_H.c.operation_id == operation_id, _H.c.status == HandoffStatus.OPEN.value),
            _H.c.next_check_at.is_not(None),
        )
        .values(next_check_at=db_now())
        .returning(_H.c.id)
    ).first()
    return found is not None
