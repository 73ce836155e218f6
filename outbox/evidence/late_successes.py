"""Evidence wins: a provider-confirmed success on any attempt, stale or not, means the effect happened.

A worker whose lease expired (frozen, paused, cut off) may still reach the provider and get its
2xx. Its result is written to its own attempt row, marked ``stale``, and the operation row refuses
it: the token moved on. That refusal is about who owns the operation, not about what happened at
the provider, so the ledger then applies the evidence:

- from a state that claims no outcome yet (awaiting_approval, not_dispatched, dispatching,
  outcome_unknown, reconciliation_required, abandoned) -> ``succeeded`` with that reference and evidence
  (``committed_evidence_degraded`` if a separate evidence store is down). The token is bumped, so
  whoever holds the lease now finds its own write refused; an open handoff is closed as settled;
- from a terminal state that says "no effect" (failed_before_commit, cancelled) ->
  ``reconciliation_required`` with a handoff. The guards (effect_guard.py) make this unreachable
  unless something upstream lied: an action that declares ``provider_fencing`` for a provider that
  does not fence, or a person's wrong "not executed". The agent was told it did not happen and may
  have acted on that, so a person reviews; the event ``late evidence contradicts`` flags it for
  the report;
- already succeeded: nothing to do (a different reference there is a second effect at the
  provider: the report lists it).

A worker applies its own late success right after committing the stale attempt row (its own
transaction, so the evidence is committed first); the relay's sweep applies any a worker did not
live to apply (``apply_unapplied``). Applying stamps the attempt's ``applied_at``: each late
success is applied once, and a person's later decision is not overridden by evidence they saw.
A stale result that is not a success (a zombie's late failure or timeout, a refused lookup) has
nothing to apply: the sweep stamps it too (``retire_stale_results``), so the index of late results
not yet applied, whose condition cannot read the class (migration 0023), holds only what is waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.evidence.handoffs import close_by_evidence, open_handoff
from outbox.evidence.sinks import EvidenceSink, record_for
from outbox.ledger import failpoints
from outbox.ledger.clock import db_now
from outbox.ledger.models import (
    STALE_UNAPPLIED,
    UNAPPLIED_SUCCESS,
    Attempt,
    Handoff,
    Operation,
    OperationEvent,
    core_table,
)
from outbox.ledger.states import EFFECT, NO_EFFECT, AttemptClass, EventKind, HandoffStatus, Resolution, Status
from outbox.ledger.transitions import move
from outbox.ledger.writes import released, success_values
from outbox.runs.lifecycle import flag_contradiction

log = logging.getLogger(__name__)
_OP = core_table(Operation)

_AT = core_table(Attempt)

LATE_EVIDENCE_EVENT = EventKind.LATE_EVIDENCE
CONTRADICTION_EVENT = EventKind.LATE_EVIDENCE_CONTRADICTS

# (session, operation, why) -> the handoff packet; built by the caller, which knows the action
# (what to mask, where to look): workers/handoff_packet.packet_builder.
PacketBuilder = Callable[[Session, Operation, str], dict[str, Any]]


@dataclass(frozen=True)
class LateSuccess:
    """An attempt that holds the provider's confirmation while its operation does not."""

    operation_id: str
    attempt_id: int
    kind: str
    attempt_number: int
    fencing_token: int
    provider_reference: str | None
    response_digest: str | None

    @property
    def label(self) -> str:
        return f"{self.kind} attempt {self.attempt_number} (token {self.fencing_token})"


def unapplied(
    session: Session,
    *,
    attempt_ids: Sequence[int] | None = None,
    operation_ids: Sequence[str] | None = None,
    limit: int = 100,
) -> list[LateSuccess]:
    """Stale successes not yet applied, oldest first (only those of ``attempt_ids`` /
    ``operation_ids`` if given: a worker's own, the operation a reconciler is about to look up).

    Every success that did not settle its operation is stale: a success written under the
    current token moves its operation in the same statement.
    """
    # Implies the partial index ix_outbox_attempts_unapplied_successes's condition (models.STALE_UNAPPLIED): the planner reads it.
    stmt = (
        select(
            _AT.c.operation_id,
            _AT.c.id,
            _AT.c.kind,
            _AT.c.attempt_number,
            _AT.c.fencing_token,
            _AT.c.provider_reference,
            _AT.c.response_digest,
        )
        .where(text(UNAPPLIED_SUCCESS))
        .order_by(_AT.c.id)
        .limit(limit)
    )
    if attempt_ids is not None:
        stmt = stmt.where(_AT.c.id.in_(list(attempt_ids)))
    if operation_ids is not None:
        stmt = stmt.where(_AT.c.operation_id.in_(list(operation_ids)))
    return [LateSuccess(*row) for row in session.execute(stmt).all()]


def apply(
    session: Session,
    late: LateSuccess,
    *,
    actor: str,
    sink: EvidenceSink,
    packet: PacketBuilder,
    result: dict[str, Any] | None = None,
    event: EventKind = LATE_EVIDENCE_EVENT,
    why: str | None = None,
) -> Status | None:
    """Settle one operation by its late success (see the module docstring). Returns the new status,
    or None when there was nothing to do (it already holds the effect). ``event`` / ``why``: what the
    history says of a success that came another way than a worker's attempt (a provider's webhook)."""
    # populate_existing: the row as locked now, not as the caller's session may have read it before.
    locking = select(Operation).where(Operation.id == late.operation_id).with_for_update()
    op = session.execute(locking.execution_options(populate_existing=True)).scalar_one()
    status = Status(op.status)
    # Compare-and-set: another sweep, worker or reconciler may have applied it since it was read.
    stamped = session.execute(
        update(_AT)
        .where(_AT.c.id == late.attempt_id, _AT.c.applied_at.is_(None))
        .values(applied_at=db_now())
        .returning(_AT.c.id)
    ).first()
    if stamped is None or status in EFFECT:
        return None
    if status in NO_EFFECT:
        return _contradiction(session, op, status, late, actor=actor, packet=packet, said=why)
    if status is Status.RECONCILIATION_REQUIRED and _in_review(session, op.id):
        # A person is reviewing a contradiction of this operation: more evidence goes to them (it
        # is in the attempt log they read), not around them.
        return None
    record = record_for(session, op, reference=late.provider_reference, response_digest=late.response_digest)
    to = sink.write_separately(record) if sink.separate else Status.SUCCEEDED
    said = why or f"{late.label} was confirmed by the provider after its worker had lost the lease"
    reason = f"{said}: evidence wins" + (" (completed after cancel requested)" if op.cancel_requested else "")
    move(
        session,
        op.id,
        sources=[status],
        to=to,
        event=event,
        actor=actor,
        reason=reason,
        token=op.fencing_token,  # read under the row's lock: a compare-and-set, as every move
        fencing_token=_OP.c.fencing_token + 1,
        **released(),
        **success_values(late.provider_reference, late.response_digest, result),
    )
    if not sink.separate:
        sink.write(record, session=session)
    if status is Status.RECONCILIATION_REQUIRED:
        close_by_evidence(
            session,
            op.id,
            resolution=Resolution.SUCCEEDED,
            reference=late.provider_reference,
            actor=actor,
            note=f"settled by late evidence: {reason}",
            attempt_id=late.attempt_id,
        )
    log.info(
        "late evidence applied: %s -> %s",
        status.value,
        to.value,
        extra={
            "operation_id": op.id,
            "attempt": late.attempt_number,
            "fencing_token": late.fencing_token,
            "reference": late.provider_reference,
        },
    )
    return to


def _in_review(session: Session, operation_id: str) -> bool:
    """An open handoff, and a contradiction in the history: the handoff is that review."""
    flagged = (
        select(OperationEvent.id)
        .where(OperationEvent.operation_id == operation_id, OperationEvent.event == CONTRADICTION_EVENT)
        .exists()
    )
    open_handoff = (
        select(Handoff.id)
        .where(Handoff.operation_id == operation_id, Handoff.status == HandoffStatus.OPEN.value)
        .exists()
    )
    return bool(session.execute(select(flagged & open_handoff)).scalar())


def _contradiction(
    session: Session,
    op: Operation,
    status: Status,
    late: LateSuccess,
    *,
    actor: str,
    packet: PacketBuilder,
    said: str | None = None,
) -> Status:
    said = said or f"{late.label} holds the provider's confirmation"
    reason = (
        f"{said} (reference {late.provider_reference}) although "
        f"the operation ended {status.value}: the agent was told nothing happened and may have acted on it. "
        "Review, then resolve --as succeeded with that reference"
    )
    move(
        session,
        op.id,
        sources=[status],
        to=Status.RECONCILIATION_REQUIRED,
        event=CONTRADICTION_EVENT,
        actor=actor,
        reason=reason,
        token=op.fencing_token,
        fencing_token=_OP.c.fencing_token + 1,
        finished_at=None,
        result_reference=late.provider_reference,
        result_digest=late.response_digest,
    )
    fresh = session.get(Operation, op.id, populate_existing=True)
    assert fresh is not None
    open_handoff(session, op.id, reason=reason, packet=packet(session, fresh, reason))
    flag_contradiction(session, fresh, reason=reason, actor=actor)  # its run, if it is a run's step
    # A handoff, and a state that contradicted the provider: one of the ERRORs of DESIGN.md.
    log.error(
        "late evidence contradicts %s: handed to a person",
        status.value,
        extra={"operation_id": op.id, "attempt": late.attempt_number, "reference": late.provider_reference},
    )
    return Status.RECONCILIATION_REQUIRED


# Results that may still become a success (a stale attempt not answered yet) or are one: never retired.
_KEPT = (AttemptClass.SUCCEEDED.value, AttemptClass.PENDING.value)


def retire_stale_results(session: Session, *, limit: int = 1000) -> int:
    """Stamp ``applied_at`` on stale results that are not successes (nothing to apply; they stay as
    evidence), up to ``limit``, oldest first; returns how many. Read through the partial index of
    stale results not yet applied, which would otherwise keep every one of them for good."""
    ids = (
        select(_AT.c.id)
        .where(text(STALE_UNAPPLIED), _AT.c.attempt_class.not_in(_KEPT))
        .order_by(_AT.c.id)
        .limit(limit)
        .scalar_subquery()
    )
    retired = session.execute(update(_AT).where(_AT.c.id.in_(ids)).values(applied_at=db_now()))
    return int(getattr(retired, "rowcount", 0) or 0)


def apply_unapplied(
    sessions: sessionmaker[Session],
    *,
    actor: str,
    sink: EvidenceSink,
    packet: PacketBuilder,
    attempt_ids: Sequence[int] | None = None,
    operation_ids: Sequence[str] | None = None,
    results: dict[int, dict[str, Any]] | None = None,
) -> dict[str, Status]:
    """Apply every unapplied late success (only those of ``attempt_ids`` / ``operation_ids`` if
    given), one transaction each, so one that fails does not hold back the others. Returns
    operation id -> the status it moved to."""
    if attempt_ids is None and operation_ids is None:  # the sweep
        with sessions.begin() as session:
            retire_stale_results(session)
    with sessions() as session:
        found = unapplied(session, attempt_ids=attempt_ids, operation_ids=operation_ids)
    failpoints.hit("late_evidence.after_select_before_update")
    moved: dict[str, Status] = {}
    for late in found:
        # Two late successes for one operation: the first settles it, the second finds it done.
        try:
            with sessions.begin() as session:
                to = apply(
                    session, late, actor=actor, sink=sink, packet=packet, result=(results or {}).get(late.attempt_id)
                )
        except Exception:  # noqa: BLE001 - one that fails must not hold back the others
            # Left unapplied: tried again next time, listed by the report meanwhile.
            log.warning(
                "late evidence not applied; will try again",
                exc_info=True,
                extra={"operation_id": late.operation_id, "attempt": late.attempt_number},
            )
            continue
        if to is not None:
            moved[late.operation_id] = to
    return moved
