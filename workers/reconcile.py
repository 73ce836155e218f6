"""The reconciler: settle outcome_unknown by asking the provider, never by re-sending.

found succeeded -> succeeded; found failed -> failed_before_commit; found pending -> re-check;
not found -> counts only if the lookup is authoritative and settle_s has passed since the last
dispatch attempt; then (``after_not_found``) back to not_dispatched with the SAME key, or, when
the operation must end (budget spent, cancel requested, the provider rejected the key), ended:
failed_before_commit / cancelled only if no attempt can still land, else a person decides;
lookup unavailable -> re-check with backoff under the reconciler's own budget; no lookup /
reconciler budget spent -> reconciliation_required (a person decides).

Every lookup carries the reconciler's fencing token (newer than every dispatch attempt's): a
provider that fences (``provider_fencing``) refuses the older ones from then on. Evidence wins: a
success that a worker got after losing its lease settles the operation (apply_late_successes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from breaker import Allowed, Open, counts_as_failure
from downstream.actions import ActionConfig
from outbox import failpoints
from outbox.claims import Claim, claim_unknown
from outbox.clock import as_utc
from outbox.envelope import loads_exact
from outbox.models import Attempt
from outbox.states import AttemptClass, AttemptKind, Status
from workers.judge import Settlement, judge
from workers.outcomes import deadline_of, effective_budget
from workers.runtime import Runtime
from workers.settle import Looked, late, settle_all

log = logging.getLogger(__name__)


def dispatch_window(
    attempts: Sequence[DispatchAttempt], *, call_timeout_s: float, after: int = 0
) -> tuple[datetime | None, datetime | None]:
    """(when the first request may have reached the provider, the latest moment one may have).

    The first: the start of the first dispatch attempt numbered after ``after`` (attempts up to
    it were proven unable to take effect: the provider's key retention runs from the next one).
    The latest: the end of the last dispatch attempt; if its worker never reported (crashed), its
    start plus the call timeout, since the request may still have been on the wire until then.
    """
    if not attempts:
        return None, None
    since = [a for a in attempts if a.number > after] or list(attempts[-1:])
    first, last = as_utc(since[0].started_at), attempts[-1]
    ended = as_utc(last.ended_at)
    if ended is not None:
        return first, ended
    started = as_utc(last.started_at)
    assert started is not None
    return first, started + timedelta(seconds=call_timeout_s)


def reconcile_batch(
    rt: Runtime, operation_ids: Sequence[str], *, rng: random.Random | None = None, fill_to: int = 0
) -> dict[str, Settlement]:
    """A reconcile doorbell's ids: late successes first, then one claim statement for the rest,
    a lookup each, in turn, and one transaction that settles them all (each settlement still
    guarded by its own token). Returns the settlements made (ids settled otherwise are absent).

    ``fill_to``: the claim also takes other due outcome_unknown operations, oldest first, up to
    this many in all (the Celery task: OUTBOX_DOORBELL_BATCH). A doorbell only says "lookups may
    be waiting": under a backlog each task then does a full batch instead of the one or two ids
    its finalize happened to ring (issue 14: 1.4 ids per reconcile task, the reconciler the
    bottleneck of the fault mix). Those taken along get no late-success check first: a lookup
    finds the effect, and the ledger's guard refuses "no effect" while a success is on record."""
    rng = rng or random.Random()
    settled = late(rt, operation_ids=list(operation_ids))
    wanted = [op_id for op_id in operation_ids if op_id not in settled]
    also_due = max(fill_to - len(wanted), 0)
    if not wanted and not also_due:
        return {}
    with rt.sessions.begin() as session:
        claims = claim_unknown(
            session,
            worker=rt.worker_id,
            lease_s=rt.settings.lease_s,
            operation_ids=wanted,
            limit=max(len(wanted), 1),
            also_due=also_due,
        )
    # A closed breaker admits every lookup: asked once per target per doorbell, and told one
    # success at the end (each failure is told at once, and then the next lookup asks again).
    shared = _SharedBreakers({}, {})
    looked: list[Looked] = []
    try:
        for claim in claims:
            looked.append(_reconcile_claimed(rt, claim, rng, shared))
    finally:
        for decision in shared.succeeded.values():
            rt.breakers.record(decision, failure=False)
        # What was looked up is settled even if a later lookup raised (that one's lease expires
        # and it is looked up again).
        settlements = settle_all(rt, looked)
    return settlements


@dataclass
class _SharedBreakers:
    closed: dict[str, Allowed]  # target -> the closed breaker's admission, shared by the batch
    succeeded: dict[str, Allowed]  # target -> a success not yet told


def reconcile_operation(rt: Runtime, operation_id: str, *, rng: random.Random | None = None) -> Settlement | None:
    """One operation's reconcile doorbell (None: settled by a late success, or nothing to claim)."""
    return reconcile_batch(rt, [operation_id], rng=rng).get(operation_id)


def _reconcile_claimed(rt: Runtime, claim: Claim, rng: random.Random, shared: _SharedBreakers) -> Looked:
    try:
        action = rt.actions.action(claim.action)
    except KeyError:
        return Looked(
            claim,
            None,
            Settlement(
                Status.RECONCILIATION_REQUIRED,
                AttemptClass.AMBIGUOUS,
                f"unknown action {claim.action!r}: cannot look it up",
            ),
        )
    if action.lookup is None:
        return Looked(
            claim,
            None,
            Settlement(
                Status.RECONCILIATION_REQUIRED,
                AttemptClass.AMBIGUOUS,
                "no lookup declared for this action: a person must check the provider",
            ),
            action,
        )
    decision = shared.closed.get(action.target) or rt.breakers.before_call(action.target)
    if isinstance(decision, Allowed) and not decision.probe:
        shared.closed[action.target] = decision
    if isinstance(decision, Open):
        return Looked(
            claim,
            None,
            Settlement(
                claim.status,
                AttemptClass.AMBIGUOUS,
                f"breaker for {action.target} open: lookup later",
                recheck_in_s=decision.wait_s,
            ),
            action,
        )
    found = rt.connectors.for_action(claim.action).lookup(
        claim.action,
        action,
        args=loads_exact(claim.args or "{}"),
        idempotency_key=claim.provider_key,
        tenant=claim.tenant,
        fencing_token=claim.fencing_token,
    )
    failpoints.hit("reconcile.after_lookup", claim.idempotency_key)
    unavailable = found.outcome == "unavailable"
    failure = unavailable and counts_as_failure(found.status_code, transport_error=found.status_code is None)
    if not failure and not decision.probe:
        shared.succeeded[action.target] = decision
    else:
        shared.closed.pop(action.target, None)  # the next lookup asks the breaker again
        rt.breakers.record(decision, failure=failure)
    target = rt.actions.target_of(action)
    first_sent = last_activity = None
    attempts: list[DispatchAttempt] = []
    if found.outcome == "not_found":  # only "not found" is judged against the dispatch attempts
        with rt.sessions() as session:
            attempts = _dispatch_attempts(session, claim.operation_id)
        first_sent, last_activity = dispatch_window(
            attempts, call_timeout_s=target.timeout_s + target.connect_timeout_s, after=claim.proven_absent_through
        )
    verdict = judge(
        claim,
        action,
        found,
        now=claim.now(),
        last_activity=last_activity,
        first_sent=first_sent,
        rng=rng,
        max_lookups=rt.settings.reconcile_max_lookups,
        max_delay_s=rt.settings.reconcile_max_delay_s,
    )
    if verdict.to is Status.NOT_DISPATCHED:  # only after "not found": the attempts were read above
        verdict = after_not_found(claim, action, verdict, attempts, now=claim.now())
    return Looked(claim, found, verdict, action)


@dataclass(frozen=True)
class DispatchAttempt:
    """What dispatch_window and after_not_found need of one dispatch attempt row."""

    number: int
    fencing_token: int
    klass: AttemptClass
    error: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None


def _dispatch_attempts(session: Session, operation_id: str) -> list[DispatchAttempt]:
    """One read of an operation's dispatch attempts, in order: both judgements of a "not found"."""
    rows = session.execute(
        select(
            Attempt.attempt_number,
            Attempt.fencing_token,
            Attempt.attempt_class,
            Attempt.error,
            Attempt.started_at,
            Attempt.ended_at,
        )
        .where(Attempt.operation_id == operation_id, Attempt.kind == AttemptKind.DISPATCH.value)
        .order_by(Attempt.attempt_number)
    ).all()
    return [
        DispatchAttempt(
            r.attempt_number, r.fencing_token, AttemptClass(r.attempt_class), r.error, r.started_at, r.ended_at
        )
        for r in rows
    ]


def after_not_found(
    claim: Claim, action: ActionConfig, verdict: Settlement, attempts: list[DispatchAttempt], *, now: datetime
) -> Settlement:
    """Pure: the provider has no record of the key. Send again with the same key, or end it?

    What "not found" proves depends on who can still land. Earlier attempts that were ambiguous or
    never reported (a frozen worker, a provider's queue) can take effect after this lookup; no
    timeout bounds that. They cannot when the action declares ``provider_fencing`` (this lookup
    carried a newer token, which the provider holds against every older one from now on), or
    when none is open (``claim.open_ambiguity`` is false: every one was proven unable to land).

    - Send again: the key makes a late landing of an earlier attempt harmless (one effect).
    - End it, when the budget is spent, a cancel was requested, the provider rejected the last
      attempt of the key, or an earlier attempt may still land at a provider that honours no keys
      (a re-send could be a second effect): failed_before_commit (cancelled) only if nothing can land;
      otherwise a person decides. A poison intent (its worker died after claiming, every time)
      goes to a person too.
    """
    fenced = action.provider_fencing
    can_land = claim.open_ambiguity and not fenced
    budget = effective_budget(claim, action)
    last = attempts[-1] if attempts else None
    if claim.cancel_requested:
        ending = "cancel requested"
    elif claim.attempt_count >= budget.max_attempts:
        ending = f"attempts used up ({claim.attempt_count}/{budget.max_attempts})"
    elif now >= deadline_of(claim, action):
        ending = f"deadline passed ({budget.deadline_s:g}s)"
    elif last is not None and last.klass is AttemptClass.REJECTED:
        ending = f"the provider rejected attempt {last.number}: {last.error or 'rejected'}"
    elif can_land and action.provider_idempotency is None:
        # Without a key the provider cannot tell a late earlier request from a new one.
        ending = "the provider does not honour idempotency keys, so sending again could make a second effect"
    else:
        fence_note = "; every earlier attempt fenced off by this lookup" if fenced else ""
        return replace(
            verdict, reason=f"{verdict.reason}{fence_note}: re-dispatch with the same key", cannot_land=fenced
        )
    if last is not None and last.klass is AttemptClass.PENDING and claim.attempt_count >= budget.max_attempts:
        return Settlement(
            Status.RECONCILIATION_REQUIRED,
            AttemptClass.NOT_SENT,
            f"{verdict.reason}; but the attempts are used up ({claim.attempt_count}/{budget.max_attempts}) and the "
            "last worker died before reporting (poison intent?): a person must decide",
        )
    if can_land:
        open_ones = [
            a
            for a in attempts
            if a.number > claim.proven_absent_through and a.klass in (AttemptClass.AMBIGUOUS, AttemptClass.PENDING)
        ]
        which = (
            ", ".join(
                f"attempt {a.number} (token {a.fencing_token}, "
                f"{'never reported' if a.klass is AttemptClass.PENDING else 'ambiguous'})"
                for a in open_ones
            )
            or "an earlier attempt"
        )
        return Settlement(
            Status.RECONCILIATION_REQUIRED,
            AttemptClass.NOT_SENT,
            f"{verdict.reason}, and it must end ({ending}); but {which} may still take effect: a paused "
            "worker or the provider's queue can deliver it after this lookup, and this action does not declare "
            "provider_fencing. Only a person can rule it out",
        )
    to = Status.CANCELLED if claim.cancel_requested else Status.FAILED_BEFORE_COMMIT
    why = (
        "every earlier attempt fenced off by this lookup"
        if fenced and claim.open_ambiguity
        else ("no earlier attempt can still take effect")
    )
    return Settlement(to, AttemptClass.NOT_SENT, f"{verdict.reason}; {ending}; {why}")
