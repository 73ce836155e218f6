"""Retry-After parsing, full-jitter backoff, and the budget (attempts + deadline)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.actions.specs import BudgetSpec
from workers.provider.retry import (
    MAX_RETRY_AFTER_S,
    BudgetSpent,
    PlannedRetry,
    RetryBudget,
    backoff_window_s,
    next_delay_s,
    parse_retry_after,
    plan_retry,
)

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
BUDGET = RetryBudget(max_attempts=6, deadline_s=600, base_delay_s=0.5, max_delay_s=60)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0.0),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("999999", 999999.0),  # eleven days: the provider's word, never cut (the deadline decides)
        ("7200", 7200.0),
        ("9" * 40, MAX_RETRY_AFTER_S),
        (format_datetime(NOW + timedelta(seconds=90), usegmt=True), 90.0),
        ("Sat, 01 Mar 2025 12:00:30 GMT", 30.0),
        ("Saturday, 01-Mar-25 12:00:45 GMT", 45.0),  # RFC 850, obsolete but must be accepted
        ("Sat Mar  1 12:01:00 2025", 60.0),  # asctime
        ("Sat, 01 Mar 2025 11:00:00 GMT", 0.0),  # in the past: retry now
        ("Sat, 01 Mar 2030 11:00:00 GMT", (datetime(2030, 3, 1, 11, tzinfo=UTC) - NOW).total_seconds()),
        (None, None),
        ("", None),
        ("-5", None),
        ("1.5", None),
        ("soon", None),
        ("Sat, 99 Foo 2025", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, NOW) == expected


@given(st.text(max_size=40))
def test_parse_retry_after_never_raises(value: str) -> None:
    result = parse_retry_after(value, NOW)
    assert result is None or 0 <= result <= MAX_RETRY_AFTER_S


def test_budget_mirrors_config() -> None:
    cfg = BudgetSpec(max_attempts=6, deadline_s=600, base_delay_s=0.5, max_delay_s=60)
    assert RetryBudget.from_config(cfg) == BUDGET


@given(attempt=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_full_jitter_bounds(attempt: int, seed: int) -> None:
    delay_s = next_delay_s(attempt, BUDGET, None, random.Random(seed))
    window_s = min(BUDGET.base_delay_s * 2 ** (attempt - 1), BUDGET.max_delay_s)
    assert backoff_window_s(attempt, BUDGET) == pytest.approx(window_s)
    assert 0 <= delay_s <= window_s


def test_jitter_spreads_over_the_window() -> None:
    rng = random.Random(1)
    delays = [next_delay_s(5, BUDGET, None, rng) for _ in range(500)]
    assert min(delays) < 1 and max(delays) > 7  # window is 8 s: full jitter, not +-10 %


@given(attempt=st.integers(1, 20), retry_after_s=st.floats(0, MAX_RETRY_AFTER_S), seed=st.integers(0, 1000))
def test_delay_never_below_retry_after(attempt: int, retry_after_s: float, seed: int) -> None:
    assert next_delay_s(attempt, BUDGET, retry_after_s, random.Random(seed)) >= retry_after_s


def test_seeded_reproducibility() -> None:
    a = [next_delay_s(n, BUDGET, None, random.Random(42)) for n in range(1, 8)]
    b = [next_delay_s(n, BUDGET, None, random.Random(42)) for n in range(1, 8)]
    assert a == b
    assert plan_retry(attempt_number=2, budget=BUDGET, created_at=NOW, now=NOW, rng=random.Random(3)) == plan_retry(
        attempt_number=2, budget=BUDGET, created_at=NOW, now=NOW, rng=random.Random(3)
    )


def test_attempt_numbers_start_at_one() -> None:
    with pytest.raises(ValueError):
        next_delay_s(0, BUDGET, None, random.Random(0))


def test_retry_scheduled_within_budget() -> None:
    decision = plan_retry(
        attempt_number=1, budget=BUDGET, created_at=NOW, now=NOW, retry_after_s=None, rng=random.Random(0)
    )
    assert isinstance(decision, PlannedRetry)
    assert NOW <= decision.at <= NOW + timedelta(seconds=0.5)
    assert abs((decision.at - NOW).total_seconds() - decision.delay_s) < 1e-5


def test_retry_after_honoured() -> None:
    decision = plan_retry(
        attempt_number=1, budget=BUDGET, created_at=NOW, now=NOW, retry_after_s=30, rng=random.Random(0)
    )
    assert isinstance(decision, PlannedRetry) and decision.delay_s == 30 and "Retry-After" in decision.reason


def test_attempts_used_up() -> None:
    decision = plan_retry(attempt_number=6, budget=BUDGET, created_at=NOW, now=NOW, rng=random.Random(0))
    assert isinstance(decision, BudgetSpent) and "6/6" in decision.reason


def test_retry_after_past_deadline_spends_budget() -> None:
    now = NOW + timedelta(seconds=590)
    decision = plan_retry(
        attempt_number=2, budget=BUDGET, created_at=NOW, now=now, retry_after_s=30, rng=random.Random(0)
    )
    assert isinstance(decision, BudgetSpent) and "deadline" in decision.reason


def test_deadline_already_passed() -> None:
    now = NOW + timedelta(seconds=601)
    decision = plan_retry(attempt_number=1, budget=BUDGET, created_at=NOW, now=now, rng=random.Random(0))
    assert isinstance(decision, BudgetSpent)


@settings(max_examples=300)
@given(
    attempt=st.integers(1, 10),
    elapsed_s=st.floats(0, 700),
    retry_after_s=st.one_of(st.none(), st.floats(0, MAX_RETRY_AFTER_S)),
    seed=st.integers(0, 10_000),
)
def test_never_past_deadline_never_before_retry_after(
    attempt: int, elapsed_s: float, retry_after_s: float | None, seed: int
) -> None:
    now = NOW + timedelta(seconds=elapsed_s)
    decision = plan_retry(
        attempt_number=attempt,
        budget=BUDGET,
        created_at=NOW,
        now=now,
        retry_after_s=retry_after_s,
        rng=random.Random(seed),
    )
    if isinstance(decision, PlannedRetry):
        assert attempt < BUDGET.max_attempts
        assert now <= decision.at <= NOW + timedelta(seconds=BUDGET.deadline_s)
        if retry_after_s is not None:
            assert decision.at >= now + timedelta(seconds=retry_after_s)
    else:
        assert decision.reason


def test_the_ledger_clock_is_the_databases_time_advanced_by_the_monotonic_clock():
    import time as _time
    from datetime import UTC as _UTC
    from datetime import datetime as _datetime

    from outbox.ledger.clock import LedgerClock

    read_at = _datetime(2026, 11, 30, 12, 0, tzinfo=_UTC)
    clock = LedgerClock(read_at, mono=_time.monotonic() - 1.5)  # read 1.5 s ago
    assert 1.5 <= (clock.now() - read_at).total_seconds() < 2.5  # whatever this machine's wall clock says


def test_a_retry_after_beyond_an_hour_is_honoured_or_spends_the_budget() -> None:
    # Issue 15: a Retry-After of two hours used to be cut to one, so the call went out early.
    long = RetryBudget(max_attempts=5, deadline_s=86400, base_delay_s=0.5, max_delay_s=60)
    plan = plan_retry(attempt_number=1, budget=long, created_at=NOW, now=NOW, retry_after_s=7200.0)
    assert isinstance(plan, PlannedRetry) and plan.retry_after
    assert plan.at >= NOW + timedelta(seconds=7200)
    # Past the deadline: the budget is spent, the wait is not shortened to fit.
    short = RetryBudget(max_attempts=5, deadline_s=3600, base_delay_s=0.5, max_delay_s=60)
    spent = plan_retry(attempt_number=1, budget=short, created_at=NOW, now=NOW, retry_after_s=7200.0)
    assert isinstance(spent, BudgetSpent) and "Retry-After 7200s" in spent.reason
