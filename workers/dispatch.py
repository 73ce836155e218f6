"""Dispatch: claim -> budget check -> breaker -> one attempt -> classify -> one guarded finalize.

The retry loop is outside (the ledger's next_attempt_at + the relay); the breaker wraps exactly
one HTTP attempt. A read timeout may come after the provider committed: never resend, park in
outcome_unknown and let the reconciler ask the provider by key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from breaker import Allowed, Decision, Open, counts_as_failure
from outbox.claims import Claim, claim_due, read_due
from outbox.clock import LedgerClock, as_utc
from outbox.envelope import loads_exact
from outbox.errors import StaleFence
from outbox.evidence import finish_with_evidence, records_for_claims
from outbox.states import AttemptClass, Status
from outbox.transitions import (
    AttemptReport,
    Finalize,
    commit_even_if_stale,
    finalize_if_fenced,
    finalize_many_if_fenced,
)
from outbox.waits import park_for_breaker
from workers import failpoints, metrics
from workers.actions import ActionConfig
from workers.connectors import AttemptResult
from workers.outcomes import (
    Ambiguous,
    Cancelled,
    Outcome,
    Rejected,
    RetryAt,
    Succeeded,
    before_send,
    breaker_open,
    breaker_wait,
    deadline_of,
    decide,
)
from workers.reconcile import apply_late_successes
from workers.runtime import Runtime

log = logging.getLogger(__name__)


def dispatch_operation(rt: Runtime, operation_id: str) -> Outcome | None:
    """Handle one doorbell for one operation (see dispatch_batch)."""
    return dispatch_batch(rt, [operation_id]).get(operation_id)


def dispatch_batch(rt: Runtime, operation_ids: Sequence[str]) -> dict[str, Outcome]:
    """Handle one doorbell carrying one or more operation ids. Returns the outcomes applied.

    The breaker is asked before the claim: while it is open an operation is not claimed at all
    (no fencing token, no attempt number) and stays not_dispatched until the reopen time. The rest
    are claimed, with whatever else is due up to OUTBOX_DOORBELL_BATCH, called (concurrently, one
    thread each, unless the target answers within FAST_CALL_S: see _attempt_all; a batch costs
    the time of its slowest call, which the lease covers) and finalized in one transaction.
    """
    dues = _read_due(rt, operation_ids)
    if not dues:
        # Duplicate doorbell, not due yet, or already taken: the database decides, nothing to do.
        log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
        return {}
    outcomes: dict[str, Outcome] = {}
    decisions: dict[str, Decision] = {}
    # A closed breaker admits every call: ask it once per target per doorbell, not once per call.
    closed: dict[str, Allowed] = {}
    for op_id, due in dues.items():
        known = rt.actions.actions.get(due.action)
        if known is None:
            continue
        decision = closed.get(known.target) or rt.breakers.before_call(known.target)
        if isinstance(decision, Allowed) and not decision.probe:
            closed[known.target] = decision
        # Past the deadline the claim below ends it (breaker_open -> budget spent).
        if isinstance(decision, Open) and due.clock.now() + timedelta(seconds=decision.wait_s) <= deadline_of(
            due, known
        ):
            parked = park_while_open_if_due(
                rt, op_id, known, decision, spent_attempts=due.attempt_count, now=due.clock.now()
            )
            if parked is not None:
                outcomes[op_id] = parked
            continue
        decisions[op_id] = decision
    wanted = [op_id for op_id in dues if op_id not in outcomes]
    claims: list[Claim] = []
    if wanted:
        with rt.ledger.one_statement() as session:
            # A doorbell wakes a worker; the database says what is due. Under load the relay rings
            # for one or two ids at a time (it publishes as commits arrive), so the same statement
            # fills the batch with whatever else is due now; those ids' own doorbells will find
            # nothing to claim.
            claims = claim_due(
                session,
                worker=rt.worker_id,
                lease_s=rt.settings.lease_s,
                operation_ids=wanted,
                limit=len(wanted),
                also_due=max(rt.settings.doorbell_batch - len(wanted), 0),
            )
    claimed = {c.operation_id for c in claims}
    for op_id, decision in decisions.items():
        if op_id not in claimed:
            rt.breakers.release(decision)  # a probe we will not send: the next caller probes
    for claim in claims:
        failpoints.hit("dispatch.after_claim", claim.idempotency_key)
    batch = _Batch(decisions, closed)
    # Most budget left first here too: after a failed canary each call asks the breaker in turn.
    claims.sort(key=lambda c: c.attempt_count)
    results = _attempt_all(rt, claims, batch)
    for decision in batch.succeeded.values():
        # One success per target per doorbell: each failure was recorded as it happened.
        rt.breakers.record(decision, failure=False)
    for claim, _, _, _ in results:
        failpoints.hit("dispatch.after_response", claim.idempotency_key)
    outcomes.update(apply_many(rt, results))
    return outcomes


Attempted = tuple[Claim, AttemptReport, Outcome, ActionConfig | None]
# A batch's calls to a target that answers within this run one after another, not in threads:
# a batch of 10 such calls takes < 50 ms, and in-process a thread per call cost ~40% more CPU per
# operation than the calls themselves saved in waiting (bench/dispatch_profile.py, sandbox on
# the same host: 1.29-1.44 vs 0.93-1.02 ms of CPU per operation).
FAST_CALL_S = 0.005


@dataclass
class _Batch:
    """A doorbell's breaker answers: per operation (asked before the claim), per closed target."""

    decisions: dict[str, Decision]
    closed: dict[str, Allowed]
    succeeded: dict[str, Allowed] = field(default_factory=dict)  # targets whose success is not yet recorded

    def decision_for(self, claim: Claim, target: str | None) -> Decision | None:
        held = self.decisions.get(claim.operation_id)
        return held if held is not None or target is None else self.closed.get(target)


def _attempt_all(rt: Runtime, claims: Sequence[Claim], batch: _Batch) -> list[Attempted]:
    """A batch's calls: concurrently while the target looks healthy, one by one once it does not.

    The first call to each target goes alone (a canary). If it neither failed nor counted against
    the breaker, the rest of that target's calls run concurrently; otherwise they run one at a time,
    each asking the breaker again, so a batch never piles its whole width of calls onto a target
    that is going down (the breaker opens after fail_max, not after fail_max + batch).
    A target that answered the canary within FAST_CALL_S gets the rest one after another too:
    handing each call to a thread costs more CPU than such a call waits (bench/README.md).
    """
    groups: dict[str | None, list[Claim]] = {}
    for claim in claims:
        known = rt.actions.actions.get(claim.action)
        groups.setdefault(known.target if known else None, []).append(claim)
    results: list[Attempted] = []
    for target, group in groups.items():
        first = _attempt_claimed(rt, group[0], batch.decision_for(group[0], target), batch)
        results.append(first)
        rest = group[1:]
        if first[1].klass in (AttemptClass.SUCCEEDED, AttemptClass.REJECTED):
            call = functools.partial(_attempt_with_batch, rt, batch, target)
            fast = first[1].latency_s is not None and first[1].latency_s < FAST_CALL_S
            results.extend(map(call, rest) if fast else rt.pool.map(call, rest))
            continue
        if target is not None:
            batch.closed.pop(target, None)  # the canary failed: ask the breaker before each call
        for claim in rest:
            held = batch.decisions.pop(claim.operation_id, None)
            if held is not None:
                rt.breakers.release(held)
            results.append(_attempt_claimed(rt, claim, None, batch))
    return results


def _attempt_with_batch(rt: Runtime, batch: _Batch, target: str | None, claim: Claim) -> Attempted:
    return _attempt_claimed(rt, claim, batch.decision_for(claim, target), batch)


def _attempt_claimed(rt: Runtime, claim: Claim, decision: Decision | None, batch: _Batch | None = None) -> Attempted:
    try:
        action = rt.actions.action(claim.action)
    except KeyError as exc:
        if decision is not None:
            rt.breakers.release(decision)
        report = AttemptReport(AttemptClass.NOT_SENT, error=str(exc))
        return claim, report, Rejected(f"unknown action {claim.action!r}: not in the actions file"), None
    report, outcome = attempt(rt, claim, action, decision, batch)
    return claim, report, outcome, action


@dataclass(frozen=True)
class _Due:
    """A not_dispatched, due operation as read before claiming (enough for the deadline)."""

    action: str
    created_at: datetime
    deadline_at: datetime | None
    max_attempts: int | None
    attempt_count: int
    clock: LedgerClock  # the database's time when read: deadlines are judged on it


def _read_due(rt: Runtime, operation_ids: Sequence[str]) -> dict[str, _Due]:
    with rt.ledger.one_statement() as session:
        rows = read_due(session, operation_ids)
    dues = {}
    # Most budget left first: while a breaker is half-open, the first operation asked gets the
    # probe, so an outage's probes rotate even when a lagging relay rings several at once.
    for row in sorted(rows, key=lambda r: r.attempt_count):
        created, read_at = as_utc(row.created_at), as_utc(row.db_now)
        assert created is not None and read_at is not None
        dues[row.id] = _Due(
            row.action, created, as_utc(row.deadline_at), row.max_attempts, row.attempt_count, LedgerClock(read_at)
        )
    return dues


def park_while_open_if_due(
    rt: Runtime, operation_id: str, action: ActionConfig, decision: Open, *, spent_attempts: int, now: datetime
) -> RetryAt | None:
    """Breaker open: not sent, not claimed; the operation stays not_dispatched until the reopen time.

    No claim means no attempt row and no attempt number, so the wait costs no attempt budget (the
    deadline still applies: the caller checked it). Guarded like a claim: only a not_dispatched,
    due row moves, so a concurrent claim or park by another worker wins and we do nothing.
    """
    wait = breaker_wait(action, wait_s=decision.wait_s, now=now, spent_attempts=spent_attempts)
    with rt.sessions.begin() as session:
        if not park_for_breaker(session, operation_id, delay_s=wait.delay_s, reason=wait.why, actor=rt.worker_id):
            return None
    log.info(
        "breaker open: parked for %.3fs",
        wait.delay_s,
        extra={"operation_id": operation_id, "target": action.target, "delay_s": wait.delay_s},
    )
    return wait


def attempt(
    rt: Runtime,
    claim: Claim,
    action: ActionConfig,
    decision: Decision | None = None,
    batch: _Batch | None = None,
) -> tuple[AttemptReport, Outcome]:
    """One attempt of a claimed operation: nothing here writes to the ledger.

    decision: the breaker's answer taken before the claim (None: ask now). With ``batch``, a
    success under a closed breaker is recorded once per target when the batch ends.
    """
    early = before_send(claim, action, now=claim.now())
    if early is not None:
        if decision is not None:
            rt.breakers.release(decision)
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        return AttemptReport(AttemptClass.NOT_SENT, error=_why(early)), early
    if decision is None:
        decision = rt.breakers.before_call(action.target)
    if isinstance(decision, Open):
        outcome = breaker_open(claim, action, wait_s=decision.wait_s, now=claim.now())
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        return AttemptReport(AttemptClass.NOT_SENT, error=f"breaker open for {decision.wait_s:.3f}s more"), outcome
    connector = rt.connectors.for_action(claim.action)
    failpoints.hit("dispatch.before_send", claim.idempotency_key)
    result = connector.send(
        claim.action,
        action,
        args=loads_exact(claim.args),
        idempotency_key=claim.idempotency_key,
        fencing_token=claim.fencing_token,
    )
    c = result.classification
    # Transport failures, 5xx and 429 count against the breaker; business 4xx never do.
    failure = counts_as_failure(c.status_code, transport_error=_is_transport(result))
    if batch is not None and not failure and not decision.probe:
        batch.succeeded[action.target] = decision
    else:
        rt.breakers.record(decision, failure=failure)
    metrics.record_attempt(action.target, c.klass, result.latency_s)
    return _report(result), decide(claim, action, c, now=claim.now())


def _is_transport(result: AttemptResult) -> bool:
    # A failure with no HTTP status is a transport failure, except local validation (our bug).
    return result.status_code is None and not result.classification.reason.startswith("local_validation")


def _report(result: AttemptResult) -> AttemptReport:
    c = result.classification
    digest = None
    if c.body is not None:
        digest = hashlib.sha256(json.dumps(c.body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return AttemptReport(
        klass=c.klass,
        status_code=result.status_code,
        request_digest=result.request_digest or None,
        provider_request_id=c.provider_request_id,
        provider_reference=c.provider_reference,
        response_digest=digest,
        retry_after_s=c.retry_after_s,
        latency_s=result.latency_s,
        error=None if c.klass is AttemptClass.SUCCEEDED else f"{c.reason}: {result.raw_error or ''}"[:2000],
    )


def _why(outcome: Outcome) -> str:
    return getattr(outcome, "why", "") or ""


def _transition_of(claim: Claim, outcome: Outcome) -> tuple[Status, str, dict[str, Any]]:
    kw: dict[str, Any] = {}
    if isinstance(outcome, Succeeded):
        reason = "provider confirmed" + (" (completed after cancel requested)" if claim.cancel_requested else "")
        kw["result"] = outcome.result
        return Status.SUCCEEDED, reason, kw
    if isinstance(outcome, RetryAt):
        return Status.NOT_DISPATCHED, outcome.why, dict(delay_s=outcome.delay_s, refund_attempt=outcome.refund_attempt)
    if isinstance(outcome, Rejected):
        return Status.FAILED_BEFORE_COMMIT, outcome.why, kw
    if isinstance(outcome, Cancelled):
        return Status.CANCELLED, outcome.why, kw
    return Status.OUTCOME_UNKNOWN, outcome.why, kw


def _fields(claim: Claim, report: AttemptReport, action: ActionConfig | None) -> dict[str, Any]:
    return {
        "operation_id": claim.operation_id,
        "idempotency_key": claim.idempotency_key,
        "attempt": claim.attempt_number,
        "fencing_token": claim.fencing_token,
        "target": action.target if action else None,
        "class": report.klass.value,
        "retry_after_s": report.retry_after_s,
    }


def apply(
    rt: Runtime,
    claim: Claim,
    report: AttemptReport,
    outcome: Outcome,
    *,
    action: ActionConfig | None = None,
) -> Outcome:
    """Turn an outcome into exactly one guarded transition (evidence is kept even when stale)."""
    return apply_many(rt, [(claim, report, outcome, action)])[claim.operation_id]


def apply_many(rt: Runtime, items: Sequence[Attempted]) -> dict[str, Outcome]:
    """Finalize a batch: one transaction for all (each move still guarded by its own token).

    A stale token refuses only its own operation (its attempt evidence is kept); a separate
    evidence database needs its own write before each success, so that case goes one by one.
    """
    if rt.evidence.separate:
        return {c.operation_id: _apply_alone(rt, c, r, o, a) for c, r, o, a in items}
    applied: list[tuple[Claim, Outcome, str, dict[str, Any]]] = []
    succeeded: list[tuple[Claim, AttemptReport]] = []
    late: dict[int, dict[str, Any] | None] = {}  # refused successes: attempt id -> response body
    ends = []
    for claim, report, outcome, _ in items:
        to, reason, kw = _transition_of(claim, outcome)
        ends.append(Finalize(claim, report, to, reason, **kw))
    with rt.ledger.transaction() as session:
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
            applied.append((claim, outcome, end.reason, fields))
        # Evidence with the successes themselves: same transaction, one query, one insert.
        rt.evidence.write_many(records_for_claims(session, succeeded), session=session)
    # A failure above rolls the batch back and raises: its leases expire into outcome_unknown and
    # the reconciler settles them (an outage: workers/outage.py logs it once).
    _after(rt, applied)
    if late:
        # Committed above as evidence; now it settles its operation (evidence wins).
        apply_late_successes(rt, late)
    return {c.operation_id: o for c, _, o, _ in items}


def _apply_alone(
    rt: Runtime, claim: Claim, report: AttemptReport, outcome: Outcome, action: ActionConfig | None
) -> Outcome:
    to, reason, kw = _transition_of(claim, outcome)
    fields = _fields(claim, report, action)
    try:
        if isinstance(outcome, Succeeded):
            finish_with_evidence(
                rt.sessions,
                rt.evidence,
                claim,
                report,
                lambda session, status: finalize_if_fenced(session, claim, report, to=status, reason=reason, **kw),
            )
        else:
            commit_even_if_stale(
                rt.sessions, lambda session: finalize_if_fenced(session, claim, report, to=to, reason=reason, **kw)
            )
    except StaleFence as exc:
        log.info("stale fence: result kept as evidence (%s)", exc, extra=fields)
        if isinstance(outcome, Succeeded):
            apply_late_successes(rt, {claim.attempt_id: outcome.result})
        return outcome
    _after(rt, [(claim, outcome, reason, fields)])
    return outcome


def _after(rt: Runtime, applied: Sequence[tuple[Claim, Outcome, str, dict[str, Any]]]) -> None:
    """After the commit: one log line per operation, then the doorbells that follow from it."""
    reconcile, redispatch = [], []
    for claim, outcome, reason, fields in applied:
        _log_outcome(outcome, reason, fields)
        metrics.record_outcome(_transition_of(claim, outcome)[0])
        if isinstance(outcome, RetryAt):
            metrics.record_retry(fields["target"], outcome.delay_s, fields.get("retry_after_s"))
        if isinstance(outcome, Ambiguous):
            reconcile.append(claim.operation_id)
        elif isinstance(outcome, RetryAt) and outcome.delay_s <= 0:
            redispatch.append(claim.operation_id)
    if reconcile:
        rt.doorbell.ring_reconcile(reconcile)
    if redispatch:
        rt.doorbell.ring_dispatch(redispatch)


def _log_outcome(outcome: Outcome, reason: str, fields: dict[str, Any]) -> None:
    if isinstance(outcome, Succeeded):
        log.info("succeeded", extra=fields | {"reference": outcome.reference})
    elif isinstance(outcome, RetryAt):
        log.info("retry scheduled in %.3fs: %s", outcome.delay_s, reason, extra=fields | {"delay_s": outcome.delay_s})
    elif isinstance(outcome, Ambiguous):
        log.info("parked in outcome_unknown: %s", reason, extra=fields)
    elif isinstance(outcome, Cancelled):
        log.info("cancelled before send", extra=fields)
    else:
        # The only ERROR of the normal path: a final failure, with proof that nothing happened.
        log.error("failed_before_commit: %s", reason, extra=fields)
