"""Retry budget, backoff and Retry-After (DESIGN.md, "Retry budget").

Pure functions with injected clocks and randomness: nothing here sleeps. The worker stores the
returned time as the operation's ``next_attempt_at``; the ledger, not the broker, waits.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, Protocol

import tenacity

if TYPE_CHECKING:
    from outbox.actions.specs import BudgetSpec

# The provider's word is never shortened: a wait longer than the deadline allows spends the
# budget (plan_retry) instead of calling early. Only values past a century are read as one
# century (longer than any deadline), so date arithmetic cannot overflow.
MAX_RETRY_AFTER_S = 100 * 365.25 * 86400.0

_DELTA_SECONDS = re.compile(r"^\d+$")
# RFC 9110 section 5.6.7: recipients must accept the obsolete RFC 850 and asctime forms too.
_OBSOLETE_DATE_FORMATS = ("%A, %d-%b-%y %H:%M:%S GMT", "%a %b %d %H:%M:%S %Y")


class Rng(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


@dataclass(frozen=True)
class RetryBudget:
    """Per-operation retry budget; mirrors the actions file's ``budget``."""

    max_attempts: int = 5
    deadline_s: float = 3600.0
    base_delay_s: float = 0.5
    max_delay_s: float = 60.0

    @classmethod
    def from_config(cls, cfg: BudgetSpec) -> RetryBudget:
        return cls(
            max_attempts=cfg.max_attempts,
            deadline_s=cfg.deadline_s,
            base_delay_s=cfg.base_delay_s,
            max_delay_s=cfg.max_delay_s,
        )


@dataclass(frozen=True)
class PlannedRetry:
    """Try again at ``at`` (never before a Retry-After, never past the deadline)."""

    at: datetime
    delay_s: float
    reason: str
    retry_after: bool = False  # the provider's Retry-After, not our backoff, set the delay


@dataclass(frozen=True)
class BudgetSpent:
    """No further attempt: attempts are used up, or the next one could not start before the deadline."""

    reason: str


RetryDecision = PlannedRetry | BudgetSpent


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or HTTP-date), as asked.

    Garbage and negative numbers give None (the caller falls back to backoff). A date in the
    past gives 0.0: the provider said "from then on", which has already come.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if _DELTA_SECONDS.match(text):
        return min(float(int(text[:20])), MAX_RETRY_AFTER_S)
    when = parse_http_date(text)
    if when is None:
        return None
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    delta_s = (when - now).total_seconds()
    return min(max(delta_s, 0.0), MAX_RETRY_AFTER_S)


def parse_http_date(text: str) -> datetime | None:
    """An HTTP-date (IMF-fixdate or an obsolete form) as an aware UTC datetime, or None."""
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        when = None
    if when is None:
        for fmt in _OBSOLETE_DATE_FORMATS:
            try:
                when = datetime.strptime(text, fmt)
                break
            except ValueError:
                continue
    if when is None:
        return None
    # HTTP-dates are always GMT; parsedate gives naive datetimes for "-0000".
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


class _SeededRandomExponential(tenacity.wait_random_exponential):
    """tenacity's full-jitter exponential wait, drawing from an injected RNG.

    tenacity draws from the global ``random`` module; tests and replays need a seeded source,
    so only the draw is replaced and the window (multiplier * 2**(n-1), capped at max) is
    still tenacity's ``wait_exponential``.
    """

    def __init__(self, rng: Rng, *, floor_ratio: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rng = rng
        self._floor_ratio = floor_ratio

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        high = tenacity.wait_exponential.__call__(self, retry_state)
        return self._rng.uniform(max(self.min, high * self._floor_ratio), high)


def _call_state(attempt_number: int) -> tenacity.RetryCallState:
    # Wait strategies only read attempt_number; a real Retrying object keeps the type honest.
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt_number
    return state


def backoff_window_s(attempt: int, budget: RetryBudget) -> float:
    """Upper bound of the jittered delay after ``attempt`` (1-based): min(base * 2**(n-1), max)."""
    wait = tenacity.wait_exponential(multiplier=budget.base_delay_s, max=budget.max_delay_s)
    return float(wait(_call_state(attempt)))


def next_delay_s(
    attempt: int, budget: RetryBudget, retry_after_s: float | None, rng: Rng | None = None, *, floor_ratio: float = 0.0
) -> float:
    """Delay before the attempt after ``attempt`` (1-based): full jitter, at least Retry-After.

    The one backoff of dispatch and the reconciler. ``floor_ratio``: draw from [ratio * window,
    window] instead of [0, window] (the reconciler's re-checks use 0.5).
    """
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    wait = _SeededRandomExponential(
        rng if rng is not None else random.Random(),
        multiplier=budget.base_delay_s,
        max=budget.max_delay_s,
        floor_ratio=floor_ratio,
    )
    delay_s = float(wait(_call_state(attempt)))
    if retry_after_s is not None and math.isfinite(retry_after_s):
        delay_s = max(delay_s, retry_after_s)
    return delay_s


def plan_retry(
    *,
    attempt_number: int,
    budget: RetryBudget,
    created_at: datetime,
    now: datetime,
    retry_after_s: float | None = None,
    rng: Rng | None = None,
) -> RetryDecision:
    """Decide whether the operation gets another attempt after ``attempt_number`` failed.

    Attempt numbers are 1-based and count every attempt that was sent or tried (breaker-open
    waits should not be counted by the caller). The deadline runs from the intent's creation.
    A jittered backoff that would overshoot the deadline is clamped to it (backoff is our own
    politeness); a Retry-After that overshoots it is not (the provider's word), so the budget is spent.
    """
    if attempt_number >= budget.max_attempts:
        return BudgetSpent(f"attempts used up ({attempt_number}/{budget.max_attempts})")
    deadline = created_at + timedelta(seconds=budget.deadline_s)
    if now >= deadline:
        return BudgetSpent(f"deadline passed ({budget.deadline_s:g}s after creation)")
    earliest_s = retry_after_s if retry_after_s is not None else 0.0
    if now + timedelta(seconds=earliest_s) > deadline:
        return BudgetSpent(
            f"Retry-After {earliest_s:g}s would land past the deadline ({(deadline - now).total_seconds():g}s left)"
        )
    delay_s = next_delay_s(attempt_number, budget, retry_after_s, rng)
    # Rounded up to whole microseconds so the retry never lands a hair before Retry-After.
    at = now + timedelta(microseconds=math.ceil(delay_s * 1_000_000))
    reason = f"attempt {attempt_number + 1}/{budget.max_attempts} after {delay_s:.3f}s"
    honoured = retry_after_s is not None and delay_s <= retry_after_s
    if honoured:
        reason += " (Retry-After)"
    if at > deadline:
        at, delay_s = deadline, (deadline - now).total_seconds()
        reason = f"attempt {attempt_number + 1}/{budget.max_attempts} at the deadline (backoff clamped)"
    return PlannedRetry(at=at, delay_s=delay_s, reason=reason, retry_after=honoured)
