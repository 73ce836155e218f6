"""The reconciler: settle outcome_unknown by asking the provider, never by re-sending.

found succeeded -> succeeded; found failed -> failed_before_commit; found pending -> re-check;
not found -> "never executed" only if the lookup is authoritative and settle_s has passed since
the last dispatch attempt (then back to not_dispatched with the SAME key); lookup unavailable ->
re-check with backoff under the reconciler's own budget; no lookup / budget spent ->
reconciliation_required (a person decides).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from breaker import Open, counts_as_failure
from outbox.claims import Claim, claim_unknown
from outbox.clock import as_utc
from outbox.envelope import loads_exact
from outbox.errors import StaleFence
from outbox.evidence import finish_with_evidence
from outbox.handoffs import open_handoff
from outbox.models import Attempt, Operation
from outbox.settlement import settle_if_fenced
from outbox.states import AttemptClass, Status
from outbox.transitions import AttemptReport, commit_even_if_stale
from workers import failpoints, metrics
from workers.actions import ActionConfig
from workers.connectors import LookupResult
from workers.handoff_packet import build_packet
from workers.outcomes import effective_budget
from workers.runtime import Runtime

log = logging.getLogger(__name__)
UTC = timezone.utc

# The reconciler's own budget, separate from the dispatch budget: lookups are cheap and safe,
# so it keeps asking for a while before it bothers a person. Defaults of
# Settings.reconcile_max_lookups / reconcile_max_delay_s (OUTBOX_RECONCILE_MAX_LOOKUPS,
# OUTBOX_RECONCILE_MAX_DELAY_S), which the worker passes in.
MAX_LOOKUPS = 12
RECHECK_BASE_S = 1.0
RECHECK_MAX_S = 60.0


@dataclass(frozen=True)
class Settlement:
    to: Status
    klass: AttemptClass
    reason: str
    recheck_in_s: float = 0.0
    reference: Optional[str] = None


def last_dispatch_activity(session: Session, operation_id: str, *, call_timeout_s: float) -> Optional[datetime]:
    """The latest moment the provider may have received our request.

    The end of the last dispatch attempt; if its worker never reported (crashed), its start plus
    the call timeout, since the request may still have been on the wire until then.
    """
    row = session.execute(
        select(Attempt.started_at, Attempt.ended_at)
        .where(Attempt.operation_id == operation_id, Attempt.kind == "dispatch")
        .order_by(Attempt.attempt_number.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    ended = as_utc(row.ended_at)
    if ended is not None:
        return ended
    started = as_utc(row.started_at)
    assert started is not None
    return started + timedelta(seconds=call_timeout_s)


def recheck_delay_s(lookup_number: int, rng: random.Random, *, max_delay_s: float = RECHECK_MAX_S) -> float:
    window = min(max_delay_s, RECHECK_BASE_S * 2 ** max(lookup_number - 1, 0))
    return rng.uniform(window / 2, window)


def judge(
    claim: Claim,
    action: ActionConfig,
    found: LookupResult,
    *,
    now: datetime,
    last_activity: Optional[datetime],
    rng: random.Random,
    max_lookups: int = MAX_LOOKUPS,
    max_delay_s: float = RECHECK_MAX_S,
) -> Settlement:
    """Pure: what a lookup answer proves for this operation.

    ``max_lookups`` / ``max_delay_s``: the reconciler's budget (Settings.reconcile_max_lookups,
    reconcile_max_delay_s).
    """
    spec = action.lookup
    assert spec is not None
    if found.outcome == "found":
        if found.state == "succeeded":
            return Settlement(Status.SUCCEEDED, AttemptClass.SUCCEEDED, "reconciled: found at the provider",
                              reference=found.provider_reference)
        if found.state == "failed":
            return Settlement(Status.FAILED_BEFORE_COMMIT, AttemptClass.REJECTED,
                              "reconciled: the provider holds it as failed/cancelled")
        return _recheck(claim, f"found, still {found.state}: re-check later", rng,
                        max_lookups=max_lookups, max_delay_s=max_delay_s)
    if found.outcome == "not_found":
        if not spec.authoritative_not_found:
            return _recheck(claim, "not found, and this lookup is not authoritative", rng,
                            max_lookups=max_lookups, max_delay_s=max_delay_s)
        # "Not found" counts only once the provider's index lag has passed since the request
        # may last have landed.
        settled_at = (last_activity or now) + timedelta(seconds=spec.settle_s)
        if now < settled_at:
            wait_s = (settled_at - now).total_seconds()
            return Settlement(Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS,
                              f"not found yet, inside the settle window: re-check in {wait_s:.1f}s",
                              recheck_in_s=wait_s)
        return Settlement(Status.NOT_DISPATCHED, AttemptClass.NOT_SENT,
                          f"authoritative not found after settle_s={spec.settle_s:g}s: re-dispatch with the same key")
    return _recheck(claim, f"lookup unavailable: {found.reason}", rng,
                    max_lookups=max_lookups, max_delay_s=max_delay_s)


def _recheck(claim: Claim, reason: str, rng: random.Random, *, max_lookups: int, max_delay_s: float) -> Settlement:
    if claim.attempt_number >= max_lookups:
        return Settlement(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS,
                          f"{reason}; reconciler budget spent ({max_lookups} lookups): a person must decide")
    return Settlement(Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS, reason,
                      recheck_in_s=recheck_delay_s(claim.attempt_number, rng, max_delay_s=max_delay_s))


def reconcile_operation(rt: Runtime, operation_id: str, *, rng: Optional[random.Random] = None) -> Optional[Settlement]:
    rng = rng or random.Random()
    with rt.sessions.begin() as session:
        claims = claim_unknown(session, worker=rt.worker_id, lease_s=rt.settings.lease_s, operation_id=operation_id)
    if not claims:
        return None
    claim = claims[0]
    try:
        action = rt.actions.action(claim.action)
    except KeyError:
        return _settle(rt, claim, None, Settlement(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS,
                                                   f"unknown action {claim.action!r}: cannot look it up"))
    if action.lookup is None:
        return _settle(rt, claim, None, Settlement(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS,
                                                   "no lookup declared for this action: a person must check the provider"),
                       action)
    decision = rt.breakers.before_call(action.target)
    if isinstance(decision, Open):
        wait_s = max((decision.reopens_at - datetime.now(UTC)).total_seconds(), 0.0)
        return _settle(rt, claim, None, Settlement(Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS,
                                                   f"breaker for {action.target} open: lookup later", recheck_in_s=wait_s),
                       action)
    found = rt.connectors.for_action(claim.action).lookup(
        claim.action, action, args=loads_exact(claim.args), idempotency_key=claim.idempotency_key
    )
    failpoints.hit("reconcile.after_lookup", claim.idempotency_key)
    unavailable = found.outcome == "unavailable"
    rt.breakers.record(decision, failure=unavailable and counts_as_failure(found.status_code, transport_error=found.status_code is None))
    target = rt.actions.target_of(action)
    with rt.sessions() as session:
        last_activity = last_dispatch_activity(
            session, claim.operation_id, call_timeout_s=target.timeout_s + target.connect_timeout_s
        )
    verdict = judge(claim, action, found, now=datetime.now(UTC), last_activity=last_activity, rng=rng,
                    max_lookups=rt.settings.reconcile_max_lookups, max_delay_s=rt.settings.reconcile_max_delay_s)
    if verdict.to is Status.NOT_DISPATCHED:
        verdict = _cap_redispatch(rt, claim, action, verdict)
    return _settle(rt, claim, found, verdict, action)


def _cap_redispatch(rt: Runtime, claim: Claim, action: ActionConfig, verdict: Settlement) -> Settlement:
    """Never executed, but the dispatch budget is spent: end it instead of re-dispatching.

    If the last attempt was reported, the proof of absence covers every attempt: failed_before_commit.
    If its worker died after claiming, hand it to a person.

    A poison intent (its worker crashes on every claim, before it can send or report) would
    otherwise cycle claim -> crash -> lease expiry -> lookup -> re-dispatch forever, killing a
    worker each time: the claim past the cap is what dies, before the budget check can run.
    """
    max_attempts = effective_budget(claim, action).max_attempts
    if claim.attempt_count < max_attempts:
        return verdict
    with rt.sessions() as session:
        last = session.execute(
            select(Attempt.attempt_class)
            .where(Attempt.operation_id == claim.operation_id, Attempt.kind == "dispatch")
            .order_by(Attempt.attempt_number.desc())
            .limit(1)
        ).scalar_one_or_none()
    if last != AttemptClass.PENDING.value:
        # Proven absent and no attempt left: end it here rather than claim once more only to
        # find the budget spent (which also left attempt_count one above the cap).
        return Settlement(
            Status.FAILED_BEFORE_COMMIT, AttemptClass.NOT_SENT,
            f"{verdict.reason}; attempts used up ({claim.attempt_count}/{max_attempts}): no effect, no attempt left",
        )
    return Settlement(
        Status.RECONCILIATION_REQUIRED, AttemptClass.NOT_SENT,
        f"{verdict.reason}; but the attempts are used up ({claim.attempt_count}/{max_attempts}) and the "
        "last worker died before reporting (poison intent?): a person must decide",
    )


def _settle(rt: Runtime, claim: Claim, found: Optional[LookupResult], verdict: Settlement,
            action: Optional[ActionConfig] = None) -> Settlement:
    report = AttemptReport(
        klass=verdict.klass,
        status_code=found.status_code if found else None,
        provider_reference=verdict.reference or (found.provider_reference if found else None),
        latency_s=found.latency_s if found else None,
        error=None if verdict.to is Status.SUCCEEDED else (f"{found.reason}: " if found else "") + verdict.reason,
    )
    fields = {"operation_id": claim.operation_id, "idempotency_key": claim.idempotency_key,
              "fencing_token": claim.fencing_token, "lookup": claim.attempt_number}
    result = found.obj if found and verdict.to is Status.SUCCEEDED else None

    def settle(session: Session, to: Status) -> None:
        settle_if_fenced(session, claim, report, to=to, reason=verdict.reason,
                         recheck_in_s=verdict.recheck_in_s, result=result)
        if to is Status.RECONCILIATION_REQUIRED:
            op = session.get(Operation, claim.operation_id)
            assert op is not None
            packet = build_packet(session, op, reason=verdict.reason, action=action, actions=rt.actions)
            open_handoff(session, claim.operation_id, reason=verdict.reason, packet=packet)

    applied = verdict.to
    try:
        if verdict.to is Status.SUCCEEDED:
            applied = finish_with_evidence(rt.sessions, rt.evidence, claim, report, settle)
        else:
            commit_even_if_stale(rt.sessions, lambda session: settle(session, verdict.to))
    except StaleFence as exc:
        log.info("stale fence: lookup kept as evidence only (%s)", exc, extra=fields)
        return verdict
    if applied is Status.FAILED_BEFORE_COMMIT:
        log.error("failed_before_commit: %s", verdict.reason, extra=fields)  # a final failure
    elif applied is Status.RECONCILIATION_REQUIRED:
        # A handoff to a person is one of the two ERRORs of the normal path (DESIGN.md, Logging).
        log.error("handed to a person: %s", verdict.reason, extra=fields)
    else:
        log.info("reconcile: %s -> %s", verdict.reason, applied.value, extra=fields)
    metrics.record_outcome(applied)
    if applied is Status.NOT_DISPATCHED:
        rt.doorbell.ring_dispatch([claim.operation_id])
    return verdict
