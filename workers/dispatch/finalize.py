"""Finalize: each attempt's outcome becomes exactly one guarded move, then its log line and doorbells.

A batch's moves commit in one transaction (each still guarded by its own token): a stale token
refuses only its own operation, whose attempt evidence is kept. A success refused that way is a
late success: it settles its operation after the commit (evidence wins).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import StaleFence
from outbox.evidence.handoffs import open_handoff
from outbox.evidence.sinks import finish_with_evidence, records_for_claims
from outbox.evidence.stored_events import due_now
from outbox.ledger.claims import Claim
from outbox.ledger.models import Operation
from outbox.ledger.states import AttemptClass, Status, WaitingFor
from outbox.ledger.transitions import (
    AttemptReport,
    Finalize,
    commit_even_if_stale,
    finalize_if_fenced,
    finalize_many_if_fenced,
)
from workers.dispatch.fan_out import Attempted
from workers.engine import call_events
from workers.engine.authority import hold_if_stopped, is_hold
from workers.engine.committer import Committer
from workers.engine.handoff_packet import build_packet
from workers.engine.outcomes import (
    Accepted,
    Ambiguous,
    AttemptOutcome,
    Cancelled,
    FailedAtProvider,
    NeedsApproval,
    NeedsPerson,
    Rejected,
    RetryAt,
    Succeeded,
)
from workers.ground import metrics
from workers.provider.actions import ActionConfig

log = logging.getLogger(__name__)

# A move made: the claim, its outcome, the status it moved to, the reason, its log fields.
Finalized = tuple[Claim, AttemptOutcome, Status, str, dict[str, Any]]


def _transition_of(claim: Claim, outcome: AttemptOutcome) -> tuple[Status, str, dict[str, Any]]:
    kw: dict[str, Any] = {}
    if isinstance(outcome, Succeeded):
        # A cancel asked for while the request was out is noted by the write itself (writes.py).
        kw["result"] = outcome.result
        return Status.SUCCEEDED, "provider confirmed", kw
    if isinstance(outcome, Accepted):
        kw.update(result=outcome.result, delay_s=outcome.check_in_s)
        return Status.ACCEPTED, outcome.why, kw
    if isinstance(outcome, FailedAtProvider):
        return Status.FAILED_AT_PROVIDER, outcome.why, kw
    if isinstance(outcome, RetryAt):
        kw.update(delay_s=outcome.delay_s, refund_attempt=outcome.refund_attempt, waiting_for=outcome.waiting_for)
        return Status.NOT_DISPATCHED, outcome.why, kw
    if isinstance(outcome, Rejected):
        return Status.FAILED_BEFORE_COMMIT, outcome.why, kw
    if isinstance(outcome, Cancelled):
        return Status.CANCELLED, outcome.why, kw
    if isinstance(outcome, NeedsApproval):
        kw.update(refund_attempt=True, waiting_for=WaitingFor.APPROVAL)
        return Status.AWAITING_APPROVAL, outcome.why, kw
    if isinstance(outcome, NeedsPerson):
        kw.update(waiting_for=outcome.waiting_for)
        return Status.RECONCILIATION_REQUIRED, outcome.why, kw
    return Status.OUTCOME_UNKNOWN, outcome.why, kw


def _fields(claim: Claim, report: AttemptReport, action: ActionConfig | None) -> dict[str, Any]:
    return claim.log_fields() | {
        "target": action.target if action else None,
        "class": report.klass.value,
        "retry_after_s": report.retry_after_s,
        "latency_s": report.latency_s,
    }


def finalize_attempts(rec: Committer, items: Sequence[Attempted]) -> dict[str, AttemptOutcome]:
    """Finalize a batch: one transaction for all (each move still guarded by its own token).

    A stale token refuses only its own operation (its attempt evidence is kept); a separate
    evidence database needs its own write before each success, so that case goes one by one.
    """
    if rec.evidence.separate:
        return {c.operation_id: _finalize_alone(rec, c, r, o, a) for c, r, o, a in items}
    # A handoff writes its packet through the ORM, a stopped subject's hold under the stop's lock
    # (rare: a refusal a person must look at, an emergency stop): alone.
    outcomes = {c.operation_id: o for c, _, o, _ in items}
    for c, r, o, a in items:
        if _alone(o):
            outcomes[c.operation_id] = _finalize_alone(rec, c, r, o, a)
    items = [item for item in items if not _alone(item[2])]
    applied: list[Finalized] = []
    succeeded: list[tuple[Claim, AttemptReport]] = []
    late: dict[int, dict[str, Any] | None] = {}  # refused successes: attempt id -> response body
    ends = []
    for claim, report, outcome, _ in items:
        to, reason, kw = _transition_of(claim, outcome)
        ends.append(Finalize(claim, report, to, reason, **kw))
    with rec.ledger.transaction() as session:
        refusals = finalize_many_if_fenced(session, ends)
        for (claim, report, outcome, action), end, refused in zip(items, ends, refusals):
            fields = _fields(claim, report, action)
            if refused is not None:
                # Another worker (or the sweep) owns it now; our evidence is on our attempt row.
                log.info("refused: result kept as evidence (%s)", refused, extra=fields)
                if report.klass is AttemptClass.SUCCEEDED:
                    late[claim.attempt_id] = end.result
                continue
            if end.to is Status.SUCCEEDED:
                succeeded.append((claim, report))
            applied.append((claim, outcome, end.to, end.reason, fields))
        # Evidence with the successes themselves: same transaction, one query, one insert.
        rec.evidence.write_many(records_for_claims(session, succeeded), session=session)
    # A failure above rolls the batch back and raises: its leases expire into outcome_unknown and
    # the reconciler settles them (an outage: workers/ground/outage.py logs it once).
    _after(rec, applied)
    if late:
        # Committed above as evidence; now it settles its operation (evidence wins).
        rec.late_successes(attempt_results=late)
    return outcomes


def _alone(outcome: AttemptOutcome) -> bool:
    return isinstance(outcome, NeedsPerson) or is_hold(outcome)


def _finalize_alone(
    rec: Committer, claim: Claim, report: AttemptReport, outcome: AttemptOutcome, action: ActionConfig | None
) -> AttemptOutcome:
    fields = _fields(claim, report, action)
    if is_hold(outcome):
        try:
            if commit_even_if_stale(rec.sessions, lambda session: hold_if_stopped(session, claim, report)):
                _after(rec, [(claim, outcome, Status.NOT_DISPATCHED, _why(outcome), fields)])
                return outcome
        except StaleFence as exc:
            log.info("stale fence: not held (%s)", exc, extra=fields)
            return outcome
        # Resumed between the check and the hold: due at once, not held for nothing.
        outcome = RetryAt(0.0, "its subject was resumed before it was held: due now", refund_attempt=True)
    to, reason, kw = _transition_of(claim, outcome)
    try:
        if isinstance(outcome, Succeeded):
            finish_with_evidence(
                rec.sessions,
                rec.evidence,
                claim,
                report,
                lambda session, status: finalize_if_fenced(session, claim, report, to=status, reason=reason, **kw),
            )
        elif isinstance(outcome, NeedsPerson):

            def hand_over(session: Session) -> None:
                finalize_if_fenced(session, claim, report, to=to, reason=reason, **kw)
                op = session.get(Operation, claim.operation_id)
                assert op is not None
                packet = build_packet(session, op, reason=reason, action=action, actions=rec.actions)
                open_handoff(session, claim.operation_id, reason=reason, packet=packet)

            commit_even_if_stale(rec.sessions, hand_over)
        else:
            commit_even_if_stale(
                rec.sessions, lambda session: finalize_if_fenced(session, claim, report, to=to, reason=reason, **kw)
            )
    except StaleFence as exc:
        log.info("stale fence: result kept as evidence (%s)", exc, extra=fields)
        if isinstance(outcome, Succeeded):
            rec.late_successes(attempt_results={claim.attempt_id: outcome.result})
        return outcome
    _after(rec, [(claim, outcome, to, reason, fields)])
    return outcome


def _after(rec: Committer, applied: Sequence[Finalized]) -> None:
    """After the commit: one log line per operation, then the doorbells that follow from it.

    Not for what went to outcome_unknown: the relay's next tick rings the reconciler for every
    due lookup at once, OUTBOX_DOORBELL_BATCH ids a doorbell, from one process (workers/relay/loop.py). Rung from
    here, each finalize would ring for its own one or two ambiguous calls and the relay for the
    same ids again: a reconcile task per one or two lookups, each paying a Celery message, a
    late-success query, a claim and a commit, and a Celery publish in the worker's finalizer.
    The cost: a lookup starts up to OUTBOX_RELAY_POLL_S later, which an
    ambiguous outcome can afford (settle windows are longer)."""
    redispatch = []
    taken_up = []  # into the reconciler's hands, of an action that maps webhooks
    for claim, outcome, to, reason, fields in applied:
        _log_outcome(outcome, reason, fields)
        metrics.record_outcome(to)
        if isinstance(outcome, RetryAt) and not is_hold(outcome):
            metrics.record_retry(fields["target"], outcome.delay_s, fields.get("retry_after_s"))
            if outcome.delay_s <= 0:
                redispatch.append(claim.operation_id)
        elif to in (Status.ACCEPTED, Status.OUTCOME_UNKNOWN) and _maps_webhooks(rec, claim):
            taken_up.append(claim.operation_id)
    call_events.dispatched(applied)
    if redispatch:
        rec.doorbell.ring_dispatch_after_commit(redispatch)
    if taken_up:
        _events_waiting(rec, taken_up)


def _maps_webhooks(rec: Committer, claim: Claim) -> bool:
    action = rec.actions.actions.get(claim.action)
    return action is not None and action.webhooks is not None


def _events_waiting(rec: Committer, operation_ids: list[str]) -> None:
    """A webhook event kept while these were in flight (a failure, or a success named by a reference
    not recorded yet: outbox/evidence/stored_events.py) makes them due now: the reconciler's next
    claim takes the event up, or looks the object up, without waiting for the settle window. One
    statement, only for operations of actions that map webhooks; a failure here only delays that."""
    try:
        with rec.sessions.begin() as session:
            due = due_now(session, operation_ids)
    except Exception as exc:  # noqa: BLE001 - the first lookup still comes at its scheduled time
        log.warning("webhook events kept for %d operation(s) not checked: %s", len(operation_ids), type(exc).__name__)
        return
    if due:
        log.info("a webhook event came while in flight: looked at now", extra={"operation_ids": due})


def _why(outcome: AttemptOutcome) -> str:
    return getattr(outcome, "why", "") or ""


def _log_outcome(outcome: AttemptOutcome, reason: str, fields: dict[str, Any]) -> None:
    if isinstance(outcome, Succeeded):
        log.info("succeeded", extra=fields | {"reference": outcome.reference})
    elif is_hold(outcome):
        log.info("not sent: %s", reason, extra=fields)
    elif isinstance(outcome, RetryAt):
        log.info("retry scheduled in %.3fs: %s", outcome.delay_s, reason, extra=fields | {"delay_s": outcome.delay_s})
    elif isinstance(outcome, Ambiguous):
        log.info("parked in outcome_unknown: %s", reason, extra=fields)
    elif isinstance(outcome, Accepted):
        log.info("accepted, not finished: the reconciler looks it up (%s)", reason, extra=fields)
    elif isinstance(outcome, FailedAtProvider):
        log.error("failed_at_provider: %s", reason, extra=fields | {"reference": outcome.reference})  # a final failure
    elif isinstance(outcome, Cancelled):
        log.info("cancelled before send", extra=fields)
    elif isinstance(outcome, NeedsApproval):
        log.info("not sent, waiting for approval again: %s", reason, extra=fields)
    elif isinstance(outcome, NeedsPerson):
        # A handoff: one of the ERROR lines of the normal path (a person must act).
        log.error("handed to a person (%s): %s", outcome.waiting_for.value, reason, extra=fields)
    else:
        # The only ERROR of the normal path: a final failure, with proof that nothing happened.
        log.error("failed_before_commit: %s", reason, extra=fields)
