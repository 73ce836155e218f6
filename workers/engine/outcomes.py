"""What one dispatch attempt leads to, as values; ``decide`` is the policy, pure and testable.

Workers return an outcome, not a boolean. ``finalize.finalize_attempts`` turns it into exactly one guarded
transition of the ledger.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Protocol

from outbox.ledger.claims import Claim
from outbox.ledger.objects import Blocker
from outbox.ledger.states import AttemptClass, WaitingFor
from workers.provider.actions import ActionConfig
from workers.provider.classify import Classification
from workers.provider.retry import BudgetSpent, RetryBudget, Rng, plan_retry

A = AttemptClass

# The first look at an accepted operation comes no sooner than this (and no sooner than the
# lookup's settle_s): a provider that answered "processing" a moment ago will say so again.
ACCEPTED_FIRST_CHECK_S = 1.0


@dataclass(frozen=True)
class Succeeded:
    reference: str | None
    result: dict[str, Any] | None


@dataclass(frozen=True)
class Accepted:
    """The provider took it and has not finished it (a 202, or a pending status): never sent again,
    settled by lookups (the reconciler), the first one after ``check_in_s``."""

    reference: str | None
    result: dict[str, Any] | None
    why: str
    check_in_s: float


@dataclass(frozen=True)
class FailedAtProvider:
    """The provider took it and answered that it failed (a status in lookup.failed): ends
    failed_at_provider, not failed_before_commit (the provider holds a record of it)."""

    why: str
    reference: str | None = None


@dataclass(frozen=True)
class RetryAt:
    """Provably not executed (or a replay that is safe): try again after ``delay_s``."""

    delay_s: float
    why: str
    refund_attempt: bool = False  # nothing was sent (breaker open): the attempt costs nothing
    waiting_for: WaitingFor = WaitingFor.BACKOFF  # what the operation waits for until then


@dataclass(frozen=True)
class Rejected:
    """Ends failed_before_commit: provably no effect, and no further attempt allowed or useful."""

    why: str


@dataclass(frozen=True)
class Ambiguous:
    """May have happened: parked in outcome_unknown for the reconciler. Never re-sent blindly."""

    why: str


@dataclass(frozen=True)
class Cancelled:
    why: str


@dataclass(frozen=True)
class NeedsApproval:
    """Not sent: the approval on record does not cover this send (expired, another policy version,
    none): back to awaiting_approval, the attempt not counted."""

    why: str


@dataclass(frozen=True)
class NeedsPerson:
    """Not executed, and not for automation to settle: reconciliation_required with a handoff, its
    ``waiting_for`` saying what the person is asked for: credentials (the provider refused our
    authority) or a decision (a final failure the action hands to a person: on_final_failure)."""

    why: str
    waiting_for: WaitingFor


AttemptOutcome = (
    Succeeded | Accepted | FailedAtProvider | RetryAt | Rejected | Ambiguous | Cancelled | NeedsApproval | NeedsPerson
)

# An operation waiting for the evidence store is looked at again after a tenth of its age, within
# these bounds: soon after a blip (the store is often back within seconds), and at most every 30 s
# through a long outage, so a backlog of waiting operations costs a claim each per 30 s, not per second.
EVIDENCE_RECHECK_MIN_S = 1.0
EVIDENCE_RECHECK_MAX_S = 30.0


class BudgetFields(Protocol):
    """What the budget needs from an operation: a Claim, or a row read before claiming."""

    @property
    def max_attempts(self) -> int | None: ...
    @property
    def deadline_at(self) -> datetime | None: ...
    @property
    def created_at(self) -> datetime: ...


def effective_budget(claim: BudgetFields, action: ActionConfig) -> RetryBudget:
    """The action's budget, tightened by the intent's own cap (if it set one)."""
    b = action.budget
    max_attempts = b.max_attempts if claim.max_attempts is None else min(b.max_attempts, claim.max_attempts)
    deadline_s = b.deadline_s
    if claim.deadline_at is not None:
        deadline_s = min(deadline_s, (claim.deadline_at - claim.created_at).total_seconds())
    return RetryBudget(
        max_attempts=max_attempts,
        deadline_s=max(deadline_s, 0.0),
        base_delay_s=b.base_delay_s,
        max_delay_s=b.max_delay_s,
    )


def deadline_of(claim: BudgetFields, action: ActionConfig) -> datetime:
    return claim.created_at + timedelta(seconds=effective_budget(claim, action).deadline_s)


def spent(claim: Claim, action: ActionConfig, why: str) -> AttemptOutcome:
    """The budget (or the caller) ends the operation: failed only where nothing can have happened.

    An earlier attempt that may still take effect (or did: a success on record) sends it to
    outcome_unknown instead, where the reconciler asks the provider and decides with what it
    finds (effect_guard.py). So does an earlier ambiguity that a lookup proved unable to land:
    before failing, the ledger looks once more (the provider's index may have lagged).
    """
    if claim.open_ambiguity:
        return Ambiguous(f"{why}; an earlier attempt may have taken effect: looking it up before ending")
    if claim.proven_absent_through > 0 and action.lookup is not None:
        return Ambiguous(f"{why}; an earlier attempt was in doubt: looking it up once more before ending")
    if action.on_final_failure == "handoff":
        return NeedsPerson(
            f"{why}; nothing was executed, and the action hands a final failure to a person "
            "(on_final_failure: handoff) instead of failing it",
            WaitingFor.DECISION,
        )
    return Rejected(why)


def authority_refused(claim: Claim, action: ActionConfig, c: Classification) -> NeedsPerson:
    """The provider refused our authority (its status is in the target's authority_statuses): the
    request was not executed, and no retry or new argument will change that until a person has
    fixed the credentials. Never retried blindly, never failed: a person."""
    why = (
        f"{c.reason}: the provider refused our credentials for target {action.target} (revoked, expired or "
        "without the permission); nothing was executed; not retried: a person checks or rotates them"
    )
    if claim.open_ambiguity:
        why += "; an earlier attempt of this key may have taken effect: look it up before sending it again"
    return NeedsPerson(why, WaitingFor.CREDENTIALS)


def evidence_wait(claim: Claim, action: ActionConfig, *, now: datetime) -> AttemptOutcome:
    """Its action requires evidence and the separate evidence store is down: not sent (fail closed),
    back to the ledger without spending an attempt, looked at again after a tenth of its age
    (EVIDENCE_RECHECK_*). The deadline still bounds every wait: past it, it ends as the budget would."""
    why = "the evidence store is down and this action requires evidence: not sent until it is back"
    waited_s = (now - claim.created_at).total_seconds()
    recheck_s = min(EVIDENCE_RECHECK_MAX_S, max(EVIDENCE_RECHECK_MIN_S, waited_s / 10))
    if now + timedelta(seconds=recheck_s) > deadline_of(claim, action):
        return spent(claim, action, f"{why}, past the deadline")
    return RetryAt(recheck_s, why, refund_attempt=True, waiting_for=WaitingFor.EVIDENCE)


def before_send(claim: Claim, action: ActionConfig, *, now: datetime) -> AttemptOutcome | None:
    """Checks made after the claim and before anything is sent (None = go ahead)."""
    if claim.cancel_requested:
        # Nothing more is sent. If an earlier attempt may still take effect, the reconciler
        # settles what it did: succeeded if found, cancelled only once it cannot land.
        if claim.open_ambiguity:
            return Ambiguous("cancel requested; an earlier attempt may have taken effect: looking it up, not sending")
        return Cancelled("cancel requested before the request was sent")
    budget = effective_budget(claim, action)
    # attempt_count counts attempts that cost budget (breaker-open waits are refunded).
    if claim.attempt_count > budget.max_attempts:
        return spent(claim, action, f"attempts used up ({claim.attempt_count - 1}/{budget.max_attempts})")
    if now >= deadline_of(claim, action):
        # The deadline is the caller's: nothing is sent after it, whoever made the time pass. Say
        # who did: before a first attempt all of it was our own backlog, not the provider.
        waited = (now - claim.created_at).total_seconds()
        whose = "all of it waiting for a worker (our backlog)" if claim.attempt_count <= 1 else "since submit"
        return spent(
            claim,
            action,
            f"deadline passed before attempt {claim.attempt_count} ({budget.deadline_s:g}s): {waited:.1f}s {whose}",
        )
    return None


def breaker_open(claim: Claim, action: ActionConfig, *, wait_s: float, now: datetime) -> AttemptOutcome:
    """Breaker open: not sent, wait for the reopen time without spending an attempt.

    ``wait_s``: until the breaker reopens, measured on the breaker's clock; ``now``: the ledger's.
    """
    if now + timedelta(seconds=wait_s) > deadline_of(claim, action):
        return spent(claim, action, f"breaker for {action.target} stays open past the deadline")
    return breaker_wait(action, wait_s=wait_s, now=now, spent_attempts=claim.attempt_count - 1)


def limit_wait(claim: Claim, action: ActionConfig, *, wait_s: float, why: str, now: datetime) -> AttemptOutcome:
    """A limit the target declares had no room: not sent, back to the ledger for ``wait_s`` without
    spending an attempt (as a breaker wait), ``why`` naming the limit. A wait past the deadline ends
    it as the budget would (nothing was sent)."""
    if now + timedelta(seconds=wait_s) > deadline_of(claim, action):
        return spent(claim, action, f"{why}: no room for it before the deadline")
    return RetryAt(max(wait_s, 0.0), why, refund_attempt=True, waiting_for=WaitingFor.RATE_LIMIT)


def object_wait(claim: Claim, action: ActionConfig, blocker: Blocker, *, now: datetime) -> AttemptOutcome:
    """Its business object is held back by another operation (outbox/ledger/objects.py): not sent,
    back to the ledger without spending an attempt, looked at again after the blocker's recheck time.
    Still held at the deadline: it ends as the budget would (nothing was sent)."""
    why = f"waiting for its object: {blocker.describe()}"
    recheck_s = blocker.recheck_s(waited_s=(now - claim.created_at).total_seconds())
    if now + timedelta(seconds=recheck_s) > deadline_of(claim, action):
        return spent(claim, action, f"{why}, past the deadline")
    return RetryAt(recheck_s, why, refund_attempt=True, waiting_for=WaitingFor.OBJECT)


# At the reopen time the parked operation with the most budget left is due first, so it is the
# one that probes: an outage's probes rotate over the parked operations instead of draining the
# budget of whichever operation happened to probe last (it would be first in line again). 0.5 s
# per spent attempt spaces the levels beyond the relay's poll interval (0.1-0.5 s); capped so a
# recovered target costs at most 1 s of extra wait.
PROBE_ORDER_STEP_S = 0.5
PROBE_ORDER_MAX_S = 1.0


def breaker_wait(action: ActionConfig, *, wait_s: float, now: datetime, spent_attempts: int = 0) -> RetryAt:
    """The wait for an open breaker (parked with waiting_for = breaker: an operator's reset finds it).

    The reopen time in the reason is on the ledger's clock (``now`` + ``wait_s``).
    """
    order_s = min(max(spent_attempts, 0) * PROBE_ORDER_STEP_S, PROBE_ORDER_MAX_S)
    reopens_at = now + timedelta(seconds=max(wait_s, 0.0))
    return RetryAt(
        max(wait_s, 0.0) + order_s,
        f"breaker for {action.target} open until {reopens_at.isoformat()}",
        refund_attempt=True,
        waiting_for=WaitingFor.BREAKER,
    )


def after_failed_probe(
    claim: Claim, action: ActionConfig, outcome: AttemptOutcome, *, reopen_s: float, now: datetime
) -> AttemptOutcome:
    """The half-open probe failed: the breaker is open again for its whole reset window. A retry on
    the short backoff would make this operation due first when the window ends, and probe again,
    spending its budget while others wait; so it waits for the reopen time in probe order, like
    every parked operation (its attempt was sent, so it is not refunded)."""
    if not isinstance(outcome, RetryAt) or outcome.waiting_for is WaitingFor.BREAKER:
        return outcome
    if now + timedelta(seconds=reopen_s) > deadline_of(claim, action):
        return outcome  # the deadline comes first: the budget's own answer stands
    wait = breaker_wait(action, wait_s=reopen_s, now=now, spent_attempts=claim.attempt_count)
    return replace(
        wait,
        delay_s=max(wait.delay_s, outcome.delay_s),
        why=f"{outcome.why}; the probe failed: {wait.why}",
        refund_attempt=False,
    )


def decide(
    claim: Claim,
    action: ActionConfig,
    c: Classification,
    *,
    now: datetime,
    rng: Rng | None = None,
) -> AttemptOutcome:
    """The one policy: classification + budget -> outcome (DESIGN.md, failure classification)."""
    if c.klass is A.SUCCEEDED:
        return Succeeded(c.provider_reference, c.body)
    if c.klass is A.ACCEPTED:
        # The first lookup once the provider's index may show it; no lookup: a person (reconciler).
        check_in_s = max(action.lookup.settle_s, ACCEPTED_FIRST_CHECK_S) if action.lookup is not None else 0.0
        return Accepted(c.provider_reference, c.body, f"{c.reason}: accepted by the provider, not finished", check_in_s)
    if c.key_conflict:
        # The provider holds another request under this key (classify.KEY_CONFLICTS), which may have
        # taken effect. The same request would get the same answer: no replay, the lookup settles it.
        return Ambiguous(
            f"{c.reason}: the provider holds another request under this key, which may have taken effect: "
            "looked up, not sent again"
        )
    if c.failed_at_provider:
        if claim.open_ambiguity:
            # An earlier attempt is still in doubt: the provider's record (by key) decides, looked up.
            return Ambiguous(
                f"{c.reason}: the provider reports it failed; an earlier attempt is in doubt: looking it up"
            )
        return FailedAtProvider(f"{c.reason}: the provider took it and reports it failed", c.provider_reference)
    if c.authority_refused:
        return authority_refused(claim, action, c)
    if c.final:  # arguments that can never be sent: retrying would spend the budget for nothing
        return spent(claim, action, f"{c.reason} (not retried: the arguments never change)")
    budget = effective_budget(claim, action)
    plan = plan_retry(
        attempt_number=claim.attempt_count,
        budget=budget,
        created_at=claim.created_at,
        now=now,
        retry_after_s=c.retry_after_s,
        rng=rng or random.Random(),
    )
    if c.klass is A.AMBIGUOUS:
        if action.on_ambiguous == "replay" and not isinstance(plan, BudgetSpent):
            # The replay must reach the provider while it still remembers the key.
            if _inside_retention(claim, action, now + timedelta(seconds=plan.delay_s)):
                return RetryAt(plan.delay_s, f"{c.reason}: replay with the same key ({plan.reason})")
        return Ambiguous(c.reason)
    if c.klass is A.REJECTED:
        return spent(claim, action, f"{c.reason}")
    if isinstance(plan, BudgetSpent):
        return spent(claim, action, f"budget spent: {plan.reason} (last: {c.reason})")
    waiting = WaitingFor.RETRY_AFTER if plan.retry_after else WaitingFor.BACKOFF
    return RetryAt(plan.delay_s, f"{c.reason}; {plan.reason}", waiting_for=waiting)


def _inside_retention(claim: Claim, action: ActionConfig, now: datetime) -> bool:
    keys = action.provider_idempotency
    if keys is None:
        return False
    # The provider forgets keys after retention_s; a replay after that would create a second effect.
    return (now - claim.created_at).total_seconds() < keys.retention_s
