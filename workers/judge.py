"""The reconciler's judgement: what one lookup answer proves for an operation (pure).

found succeeded -> succeeded; found failed -> failed_at_provider (the provider took it and failed
it: not failed_before_commit); found pending -> accepted, re-checked; not found -> counts only if
the lookup is authoritative and settle_s has passed since the last dispatch attempt (then the
reconciler decides between re-dispatch and an end: reconcile.py), and never for an accepted
operation (the provider said it has it: its index lags); lookup unavailable -> re-check with
backoff under the reconciler's own budget, then a person.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from downstream.actions import ActionConfig
from downstream.lookups import LookupResult
from downstream.retry import Budget, next_delay_s
from outbox.claims import Claim
from outbox.states import AttemptClass, Status

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
    reference: str | None = None
    # not_dispatched: the lookup fenced every earlier attempt off (settle_if_fenced cannot_land).
    cannot_land: bool = False


def recheck_delay_s(lookup_number: int, rng: random.Random, *, max_delay_s: float = RECHECK_MAX_S) -> float:
    """The wait before lookup ``lookup_number + 1``: the dispatch backoff (downstream/retry.py), with
    half of the window as a floor (lookups that come too soon only find the same pending state)."""
    budget = Budget(base_delay_s=RECHECK_BASE_S, max_delay_s=max_delay_s)
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
) -> Settlement:
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
            return Settlement(
                Status.SUCCEEDED,
                AttemptClass.SUCCEEDED,
                "reconciled: found at the provider",
                reference=found.provider_reference,
            )
        if found.state == "failed":
            return Settlement(
                Status.FAILED_AT_PROVIDER,
                AttemptClass.REJECTED,
                "reconciled: the provider took it and holds it as failed/cancelled",
                reference=found.provider_reference,
            )
        return _recheck(
            claim,
            f"accepted by the provider, still {found.state}: re-check later",
            rng,
            max_lookups=max_lookups,
            max_delay_s=max_delay_s,
            to=Status.ACCEPTED,
            klass=AttemptClass.ACCEPTED,
            reference=found.provider_reference,
        )
    if found.outcome == "not_found":
        if claim.status is Status.ACCEPTED:
            # The provider answered that it took the request: "not found" is its index lagging,
            # never proof that nothing happened, so nothing is sent again.
            return _recheck(
                claim,
                "accepted by the provider but not found by the lookup (index lag?)",
                rng,
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        if not spec.authoritative_not_found:
            return _recheck(
                claim,
                "not found, and this lookup is not authoritative",
                rng,
                max_lookups=max_lookups,
                max_delay_s=max_delay_s,
            )
        # "Not found" counts only once the provider's index lag has passed since the request
        # may last have landed.
        settled_at = (last_activity or now) + timedelta(seconds=spec.settle_s)
        if now < settled_at:
            wait_s = (settled_at - now).total_seconds()
            return Settlement(
                claim.status,
                AttemptClass.AMBIGUOUS,
                f"not found yet, inside the settle window: re-check in {wait_s:.1f}s",
                recheck_in_s=wait_s,
            )
        forgotten = _key_forgotten(action, first_sent, now)
        if forgotten:
            return Settlement(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, forgotten)
        return Settlement(
            Status.NOT_DISPATCHED, AttemptClass.NOT_SENT, f"authoritative not found after settle_s={spec.settle_s:g}s"
        )
    return _recheck(claim, f"lookup unavailable: {found.reason}", rng, max_lookups=max_lookups, max_delay_s=max_delay_s)


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


def _recheck(
    claim: Claim,
    reason: str,
    rng: random.Random,
    *,
    max_lookups: int,
    max_delay_s: float,
    to: Status | None = None,
    klass: AttemptClass = AttemptClass.AMBIGUOUS,
    reference: str | None = None,
) -> Settlement:
    """Look again later, staying where it is (``to``: accepted once the provider says pending)."""
    if claim.attempt_number >= max_lookups:
        return Settlement(
            Status.RECONCILIATION_REQUIRED,
            klass,
            f"{reason}; reconciler budget spent ({max_lookups} lookups): a person must decide",
            reference=reference,
        )
    return Settlement(
        to or claim.status,
        klass,
        reason,
        recheck_in_s=recheck_delay_s(claim.attempt_number, rng, max_delay_s=max_delay_s),
        reference=reference,
    )
