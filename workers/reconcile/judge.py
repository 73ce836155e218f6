"""The reconciler's judgement: what one lookup answer proves for an operation (pure).

found succeeded -> succeeded; found failed -> failed_at_provider (the provider took it and failed
it: not failed_before_commit); found pending -> accepted, re-checked; several objects that are each
ours as far as lookup.match can tell -> a person, with their references; not found (finding only
others' objects is finding none) -> counts only if the lookup is authoritative and settle_s has
passed since the last dispatch attempt, and never for an accepted operation (the provider said it has it: its index lags),
nor when the lookup saw only others' objects at a provider that does not honour our key (a match that
misses our own object would make a re-send a second effect: looked up again, then a person); then (``after_not_found``)
back to not_dispatched with the SAME key, or, when the operation must end (budget spent, cancel
requested, the provider rejected the key), ended: failed_before_commit / cancelled only if no
attempt can still land, else a person decides (past the deadline alone: after the reconciler's own
lookups, which may still find a late landing); lookup unavailable -> re-check with backoff under the
reconciler's own budget, then a person.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from outbox.evidence.checks import Recheck, RecheckTerms, plan
from outbox.ledger.claims import Claim
from outbox.ledger.clock import as_utc
from outbox.ledger.states import AttemptClass, Status, WaitingFor
from workers.engine.outcomes import deadline_of, effective_budget
from workers.provider.actions import ActionConfig
from workers.provider.classify import said_key_conflict
from workers.provider.lookups import LookupResult
from workers.provider.retry import RetryBudget, next_delay_s

# The reconciler's own budget, separate from the dispatch budget: lookups are cheap and safe,
# so it keeps asking for a while before it bothers a person. Defaults of
# Settings.reconcile_max_lookups / reconcile_max_delay_s (OUTBOX_RECONCILE_MAX_LOOKUPS,
# OUTBOX_RECONCILE_MAX_DELAY_S), which the worker passes in.
MAX_LOOKUPS = 12
RECHECK_BASE_S = 1.0
RECHECK_MAX_S = 60.0


@dataclass(frozen=True)
class LookupVerdict:
    """What one lookup's answer proves for an operation (or the judgement on one not looked up): the
    status the operation moves to, what the lookup row records, and when to look again if it stays."""

    to: Status
    klass: AttemptClass
    reason: str
    recheck_in_s: float = 0.0
    reference: str | None = None
    # not_dispatched: the lookup fenced every earlier attempt off (settle_if_fenced cannot_land).
    cannot_land: bool = False
    # A person decides between these objects, each ours as far as the lookup can tell (their references).
    candidates: tuple[str, ...] = ()
    # reconciliation_required: what the person is asked for, when more than "did it happen?".
    waiting_for: WaitingFor | None = None
    # reconciliation_required: the provider's answer could still settle it, so its handoff is looked
    # up again (outbox/evidence/checks.py); None: a person's decision by design.
    recheck: Recheck | None = None


def recheck_delay_s(lookup_number: int, rng: random.Random, *, max_delay_s: float = RECHECK_MAX_S) -> float:
    """The wait before lookup ``lookup_number + 1``: the dispatch backoff (workers/provider/retry.py), with
    half of the window as a floor (lookups that come too soon only find the same pending state)."""
    budget = RetryBudget(base_delay_s=RECHECK_BASE_S, max_delay_s=max_delay_s)
    return next_delay_s(lookup_number, budget, None, rng, floor_ratio=0.5)


def judge(
    claim: Claim,
    action: ActionConfig,
    found: LookupResult,
    *,
    now: datetime,
    last_activity: datetime | None,
    rng: random.Random,
    first_sent: datetime | None = None,
    max_lookups: int = MAX_LOOKUPS,
    max_delay_s: float = RECHECK_MAX_S,
) -> LookupVerdict:
    """Pure: what a lookup answer proves for this operation.

    ``max_lookups`` / ``max_delay_s``: the reconciler's budget (Settings.reconcile_max_lookups,
    reconcile_max_delay_s). ``first_sent``: the first dispatch attempt's start; a provider that
    forgets keys after ``provider_idempotency.retention_s`` may answer "not found" for a key whose
    effect exists, so after that "not found" proves nothing and a person decides.
    """
    spec = action.lookup
    assert spec is not None
    if found.outcome == "found":
        if found.state == "succeeded":
            return LookupVerdict(
                Status.SUCCEEDED,
                AttemptClass.SUCCEEDED,
                "reconciled: found at the provider",
                reference=found.provider_reference,
            )
        if found.state == "failed":
            return LookupVerdict(
                Status.FAILED_AT_PROVIDER,
                AttemptClass.REJECTED,
                "reconciled: the provider took it and holds it as failed/cancelled",
                reference=found.provider_reference,
            )
        return recheck(
            claim,
            f"accepted by the provider, still {found.state}: re-check later",
            rng,
            max_lookups=max_lookups,
            max_delay_s=max_delay_s,
            to=Status.ACCEPTED,
            klass=AttemptClass.ACCEPTED,
            reference=found.provider_reference,
        )
    if found.outcome == "ambiguous":
        # Two objects that both pass lookup.match: adopting either could call someone else's effect
        # ours, and looking again finds the same two. A person picks (both references in the packet).
        return LookupVerdict(
            Status.RECONCILIATION_REQUIRED,
            AttemptClass.AMBIGUOUS,
            f"{len(found.candidates)} objects at the provider match this intent ({', '.join(found.candidates)}): "
            "which one, if any, is ours only a person can tell",
            candidates=found.candidates,
        )
    if found.outcome == "not_found":
        if claim.status is Status.ACCEPTED:
            # The provider answered that it took the request: "not found" is its index lagging,
            # never proof that nothing happened, so nothing is sent again.
            return recheck(
                claim,
                "accepted by the provider but not found by the lookup (index lag?)",
                rng,
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        if not spec.authoritative_not_found:
            return recheck(
                claim,
                "not found, and this lookup is not authoritative",
                rng,
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        if found.others and action.provider_idempotency is None:
            # Ours may be among them, if the match (or key_field) misses a field the provider writes
            # otherwise; a provider that does not honour our key would make a re-send a second effect.
            return recheck(
                claim,
                f"found only others' objects ({found.others}), and the provider does not honour idempotency keys "
                "(no provider_idempotency): no proof that ours was never made, so nothing is sent again",
                rng,
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        # "Not found" counts only once the provider's index lag has passed since the request
        # may last have landed.
        settled_at = (last_activity or now) + timedelta(seconds=spec.settle_s)
        if now < settled_at:
            wait_s = (settled_at - now).total_seconds()
            return LookupVerdict(
                claim.status,
                AttemptClass.AMBIGUOUS,
                f"not found yet, inside the settle window: re-check in {wait_s:.1f}s",
                recheck_in_s=wait_s,
            )
        forgotten = _key_forgotten(action, first_sent, now)
        if forgotten:
            return LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, forgotten)
        return LookupVerdict(
            Status.NOT_DISPATCHED, AttemptClass.NOT_SENT, f"authoritative not found after settle_s={spec.settle_s:g}s"
        )
    return recheck(claim, f"lookup unavailable: {found.reason}", rng, max_lookups=max_lookups, max_delay_s=max_delay_s)


def _key_forgotten(action: ActionConfig, first_sent: datetime | None, now: datetime) -> str | None:
    """Why "not found" proves nothing any more (the provider's key retention has run out), or None."""
    keys = action.provider_idempotency
    if keys is None or first_sent is None:
        return None
    since_s = (now - first_sent).total_seconds()
    if since_s <= keys.retention_s:
        return None
    return (
        f"not found, but the first attempt was {since_s:.0f}s ago and the provider keeps keys only "
        f"retention_s={keys.retention_s:g}s: an effect may exist under the forgotten key, and a re-send "
        "could make a second one; a person must decide"
    )


def recheck(
    claim: Claim,
    reason: str,
    rng: random.Random,
    *,
    max_lookups: int,
    max_delay_s: float,
    to: Status | None = None,
    klass: AttemptClass = AttemptClass.AMBIGUOUS,
    reference: str | None = None,
) -> LookupVerdict:
    """Look again later (backoff), staying where it is (``to``: accepted once the provider says
    pending), or, with the reconciler's budget spent, a person decides."""
    if claim.attempt_number >= max_lookups:
        return LookupVerdict(
            Status.RECONCILIATION_REQUIRED,
            klass,
            f"{reason}; reconciler budget spent ({max_lookups} lookups): a person must decide",
            reference=reference,
        )
    return LookupVerdict(
        to or claim.status,
        klass,
        reason,
        recheck_in_s=recheck_delay_s(claim.attempt_number, rng, max_delay_s=max_delay_s),
        reference=reference,
    )


@dataclass(frozen=True)
class DispatchAttempt:
    """What dispatch_window and after_not_found need of one dispatch attempt row."""

    number: int
    fencing_token: int
    klass: AttemptClass
    error: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None


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


def after_not_found(
    claim: Claim,
    action: ActionConfig,
    verdict: LookupVerdict,
    attempts: list[DispatchAttempt],
    *,
    now: datetime,
    rng: random.Random | None = None,
    max_lookups: int = MAX_LOOKUPS,
    max_delay_s: float = RECHECK_MAX_S,
    scope_spent: str | None = None,
) -> LookupVerdict:
    """Pure: the provider has no record of the key. Send again with the same key, or end it?

    ``scope_spent``: why its conversation's budget has no retry left (outbox/ledger/budget_charges.py),
    read by the caller for an operation in a budget scope: it ends as when its own budget is spent.

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
    - Only the deadline ends it, and an earlier attempt may still land: nothing is sent again (the
      deadline bounds sends), but the lookups go on within the reconciler's own budget
      (``max_lookups``, backoff up to ``max_delay_s``): a late landing is found and settles it,
      and only with that budget spent does a person decide. The deadline may have gone by in our
      own backlog (lookups queued behind others); that time must not hand the operation to a
      person by itself.
    """
    conflict = next(
        (a for a in attempts if a.number > claim.proven_absent_through and said_key_conflict(a.error)), None
    )
    if conflict is not None:
        # The provider said it holds another request under this key; its absence here contradicts that.
        return LookupVerdict(
            Status.RECONCILIATION_REQUIRED,
            AttemptClass.NOT_SENT,
            f"{verdict.reason}; but the provider answered attempt {conflict.number} that it holds another request "
            "under this key: a person compares what it holds with this intent (sent again it gets the same answer)",
        )
    fenced = action.provider_fencing
    can_land = claim.open_ambiguity and not fenced
    deadline_only = False  # the deadline is the only reason it must end
    budget = effective_budget(claim, action)
    last = attempts[-1] if attempts else None
    if claim.cancel_requested:
        ending = "cancel requested"
    elif claim.attempt_count >= budget.max_attempts:
        ending = f"attempts used up ({claim.attempt_count}/{budget.max_attempts})"
    elif scope_spent is not None:
        ending = scope_spent
    elif now >= deadline_of(claim, action):
        ending = f"deadline passed ({budget.deadline_s:g}s)"
        deadline_only = last is None or last.klass is not AttemptClass.REJECTED
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
        return LookupVerdict(
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
        if deadline_only and claim.attempt_number < max_lookups:
            return recheck(
                claim,
                f"{verdict.reason}; {ending}, so nothing is sent again; but {which} may still take effect: "
                f"looking again (lookup {claim.attempt_number} of {max_lookups})",
                rng or random.Random(),
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        return LookupVerdict(
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
    if to is Status.FAILED_BEFORE_COMMIT and action.on_final_failure == "handoff":
        return LookupVerdict(
            Status.RECONCILIATION_REQUIRED,
            AttemptClass.NOT_SENT,
            f"{verdict.reason}; {ending}; {why}: nothing was executed, and the action hands a final failure to a "
            "person (on_final_failure: handoff) instead of failing it",
            waiting_for=WaitingFor.DECISION,
        )
    return LookupVerdict(to, AttemptClass.NOT_SENT, f"{verdict.reason}; {ending}; {why}")


def with_recheck(verdict: LookupVerdict, action: ActionConfig | None, terms: RecheckTerms) -> LookupVerdict:
    """A handoff the provider's answer could settle keeps being looked up: one whose action has a
    lookup, handed over because the lookups could not settle it (the lookup down or lagging, an
    ambiguous attempt, still pending, an earlier attempt that may still land). Not one that asks the
    person for something no lookup answers (credentials, a decision, a request: ``waiting_for``), nor
    two matching objects (looking again finds the same two: a person picks)."""
    if verdict.to is not Status.RECONCILIATION_REQUIRED or action is None or action.lookup is None:
        return verdict
    if verdict.waiting_for is not None or verdict.candidates:
        return verdict
    keys = action.provider_idempotency
    return replace(verdict, recheck=plan(terms, keys.retention_s if keys is not None else None))
