"""One lookup of a claimed operation: ask the provider what became of its key, on a lookup thread.

Nothing here writes to the ledger: an answer (``Asked``) is judged and settled by the settler
(verdicts.settle_answers). The breaker wraps exactly one lookup, as it wraps one dispatch attempt:
a closed breaker's admission is shared by a doorbell's lookups (Admissions, breaker/admissions.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from breaker import Admissions, Decision, Open, counts_as_failure
from outbox.evidence.checks import RecheckTerms
from outbox.ledger import failpoints, tracing
from outbox.ledger.claims import Claim
from outbox.ledger.envelope import loads_exact
from outbox.ledger.states import AttemptClass
from workers.engine import call_events
from workers.engine.downstream import Downstream, addressed
from workers.ground import metrics
from workers.pacing import Deferred
from workers.provider.actions import ActionConfig
from workers.provider.lookups import LookupResult, verify_found
from workers.reconcile.judge import LookupVerdict, with_recheck

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupBudget:
    """The reconciler's own budget: lookups before a person decides, and the cap of the backoff
    between them (OUTBOX_RECONCILE_MAX_LOOKUPS, OUTBOX_RECONCILE_MAX_DELAY_S); then the slow schedule
    of a handoff's re-checks."""

    max_lookups: int
    max_delay_s: float
    # How its handoffs are looked up again once the budget is spent (OUTBOX_HANDOFF_RECHECK_*).
    rechecks: RecheckTerms = RecheckTerms()

    def with_recheck(self, verdict: LookupVerdict, action: ActionConfig | None) -> LookupVerdict:
        """``verdict``, with its handoff's re-checks when the provider's answer could settle it
        (judge.with_recheck; workers/reconcile/rechecks.py)."""
        return with_recheck(verdict, action, self.rechecks)


@dataclass(frozen=True)
class Asked:
    """One claimed operation, and what the provider answered (``found``), or why it was not asked
    and what follows (``early``)."""

    claim: Claim
    action: ActionConfig | None
    found: LookupResult | None = None
    early: LookupVerdict | None = None
    waited: str | None = None  # a declared limit it waited for before it was sent
    # The lookup was cut part-way (why): it may have reached the provider, so it counts against the
    # reconciler's budget; judged with the lookups that were sent (verdicts.settle_answers).
    cut: str | None = None
    # Webhook events the ledger held that answered it instead of a lookup (stored_events.py): their rows.
    events: tuple[int, ...] = ()


def breaker_open(claim: Claim, action: ActionConfig, decision: Open) -> LookupVerdict:
    """Not asked: the target's breaker is open; look again when it may close (staying where it is).
    Recorded not_sent: a lookup never asked is no lookup of the reconciler's budget (NOT_ASKED)."""
    return LookupVerdict(
        claim.status,
        AttemptClass.NOT_SENT,
        f"breaker for {action.target} open: lookup later",
        recheck_in_s=decision.wait_s,
    )


def limit_wait(claim: Claim, deferred: Deferred) -> LookupVerdict:
    """Not asked: a limit the target declares had no room (lookups hit the same API as the calls, so
    they count against the same limits); look again when there is room (staying where it is).
    Recorded not_sent, like breaker_open."""
    return LookupVerdict(
        claim.status, AttemptClass.NOT_SENT, f"{deferred.why}: lookup later", recheck_in_s=deferred.wait_s
    )


def ask(downstream: Downstream, admissions: Admissions, claim: Claim) -> Asked:
    """One lookup as a span of the intent's trace (``outbox.lookup``, a client span); untraced, the
    lookup alone."""
    if not tracing.enabled():
        return _ask(downstream, admissions, claim)
    with tracing.span(
        "outbox.lookup", parent=claim.traceparent, client=True, attributes=tracing.attributes_of(claim)
    ) as span:
        asked = _ask(downstream, admissions, claim)
        found = asked.found
        span.set(
            **{
                "outbox.lookup.outcome": found.outcome if found else ("cut" if asked.cut else "not_asked"),
                "http.response.status_code": found.status_code if found else None,
            }
        )
        return asked


def _ask(downstream: Downstream, admissions: Admissions, claim: Claim) -> Asked:
    """One lookup, on a lookup thread: the breaker, the target's limits, the provider's answer, the
    breaker told. Nothing here writes to the ledger (settle_answers judges and settles).
    ``admissions``: the doorbell's (after a failure the next lookup asks the breaker again)."""
    action = downstream.actions.action(claim.action)
    decision: Decision | None = None
    try:
        decision = admissions.answer_for(claim.operation_id, action.target)
        if isinstance(decision, Open):
            return Asked(claim, action, early=breaker_open(claim, action, decision))
        paced = downstream.pace(claim, action.target)
        if isinstance(paced, Deferred):
            admissions.release(decision)  # a probe not sent is handed on at once
            metrics.record_limit_released(action.target, paced.limit)
            return Asked(claim, action, early=limit_wait(claim, paced))
        args = loads_exact(claim.args or "{}")
        call_events.looking_up(claim)
        try:
            found = downstream.connectors.for_action(claim.action).lookup(
                claim.action, action, args=args, **addressed(claim)
            )
        finally:
            downstream.done(paced)
        if action.lookup is not None:  # a hook's answer is held to lookup.match as the HTTP one is
            found = verify_found(found, action.lookup, args, claim.provider_key)
        failpoints.hit("reconcile.after_lookup", claim.idempotency_key)
        unavailable = found.outcome == "unavailable"
        failure = unavailable and counts_as_failure(found.status_code, transport_error=found.status_code is None)
        admissions.went(decision, failure=failure)
        return Asked(claim, action, found, waited=paced.note())
    except Exception as exc:  # noqa: BLE001 - a lookup cut part-way proves nothing: look again later
        admissions.release(decision)  # a probe must not stay taken until its lock expires
        log.warning(
            "lookup cut part-way (%s: %s): looked up again later",
            type(exc).__name__,
            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
            extra=claim.log_fields(),
        )
        return Asked(claim, action, cut=f"the lookup was cut part-way ({type(exc).__name__})")
