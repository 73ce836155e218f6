"""Process-local breaker logic (the embedded default): no Redis, injected clock."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime

import pybreaker
import pytest

from breaker import (
    Allowed,
    BreakerConfig,
    BreakerRegistry,
    Open,
    UnknownTarget,
    counts_as_failure,
    reset,
    status,
)

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, **kw: object) -> BreakerRegistry:
    config = BreakerConfig(fail_max=3, reset_timeout_s=30, **kw)  # type: ignore[arg-type]
    return BreakerRegistry({"payments": config, "crm": config}, clock=clock)


def fail(registry: BreakerRegistry, target: str, n: int) -> None:
    for _ in range(n):
        decision = registry.before_call(target)
        assert isinstance(decision, Allowed)
        registry.record(decision, failure=True)


@pytest.mark.parametrize(
    ("status_code", "transport_error", "counts"),
    [
        (None, True, True),
        (None, False, False),
        (200, False, False),
        (400, False, False),
        (404, False, False),
        (409, False, False),
        (422, False, False),
        (429, False, True),
        (500, False, True),
        (503, False, True),
    ],
)
def test_counts_as_failure(status_code: int | None, transport_error: bool, counts: bool) -> None:
    assert counts_as_failure(status_code, transport_error) is counts


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BreakerConfig(fail_max=0, reset_timeout_s=1)
    with pytest.raises(ValueError):
        BreakerConfig(fail_max=1, reset_timeout_s=0)


def test_opens_after_fail_max_consecutive_failures_and_carries_reopen_time() -> None:
    clock = Clock()
    registry = make(clock)
    fail(registry, "payments", 2)
    ok = registry.before_call("payments")
    assert isinstance(ok, Allowed)
    registry.record(ok, failure=False)  # a success resets the consecutive count
    fail(registry, "payments", 3)
    decision = registry.before_call("payments")
    assert isinstance(decision, Open)
    assert decision.reopens_at == datetime.fromtimestamp(T0 + 30, tz=UTC)
    assert isinstance(registry.before_call("crm"), Allowed)  # targets are independent


def test_half_open_single_probe_among_threads_and_success_closes() -> None:
    clock = Clock()
    registry = make(clock)
    fail(registry, "payments", 3)
    clock.now += 30
    barrier = threading.Barrier(16)
    decisions: list[object] = []

    def call() -> None:
        barrier.wait()
        decisions.append(registry.before_call("payments"))

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    probes = [d for d in decisions if isinstance(d, Allowed)]
    assert len(probes) == 1 and probes[0].probe
    waiting = [d for d in decisions if isinstance(d, Open)]
    assert all(d.reopens_at == datetime.fromtimestamp(T0 + 31, tz=UTC) for d in waiting)
    registry.record(probes[0], failure=False)
    after = registry.before_call("payments")
    assert isinstance(after, Allowed) and not after.probe


def test_failed_probe_reopens_with_fresh_timeout() -> None:
    clock = Clock()
    registry = make(clock)
    fail(registry, "payments", 3)
    clock.now += 40
    probe = registry.before_call("payments")
    assert isinstance(probe, Allowed) and probe.probe
    registry.record(probe, failure=True)
    decision = registry.before_call("payments")
    assert isinstance(decision, Open)
    assert decision.reopens_at == datetime.fromtimestamp(T0 + 70, tz=UTC)


def test_success_threshold_needs_that_many_probe_successes() -> None:
    clock = Clock()
    registry = make(clock, success_threshold=2)
    fail(registry, "payments", 3)
    clock.now += 30
    first = registry.before_call("payments")
    assert isinstance(first, Allowed) and first.probe
    registry.record(first, failure=False)
    second = registry.before_call("payments")
    assert isinstance(second, Allowed) and second.probe  # still half-open: next probe
    registry.record(second, failure=False)
    assert registry.status(["payments"])[0].state == "closed"


def test_abandoned_probe_expires() -> None:
    clock = Clock()
    registry = make(clock, probe_timeout_s=5)
    fail(registry, "payments", 3)
    clock.now += 30
    assert isinstance(registry.before_call("payments"), Allowed)  # prober dies, no record
    assert isinstance(registry.before_call("payments"), Open)
    clock.now += 5
    assert isinstance(registry.before_call("payments"), Allowed)


def test_late_results_after_opening_neither_count_nor_close() -> None:
    clock = Clock()
    registry = make(clock)
    in_flight = [registry.before_call("payments") for _ in range(5)]
    for d in in_flight[:3]:
        registry.record(d, failure=True)  # type: ignore[arg-type]
    registry.record(in_flight[3], failure=False)  # type: ignore[arg-type]
    registry.record(in_flight[4], failure=True)  # type: ignore[arg-type]
    row = registry.status(["payments"])[0]
    assert (row.state, row.failures) == ("open", 3)


def test_decisions_do_not_serialise_threads() -> None:
    # All 8 threads are inside "their attempt" at once: nothing is held between the calls.
    registry = make(Clock())
    barrier = threading.Barrier(8, timeout=2)

    def attempt() -> None:
        decision = registry.before_call("payments")
        barrier.wait()  # would time out if before_call held a lock until record
        registry.record(decision, failure=False)  # type: ignore[arg-type]

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not barrier.broken


def test_state_changes_log_and_notify_pybreaker_listeners(
    caplog: pytest.LogCaptureFixture,
) -> None:
    changes: list[tuple[str, str]] = []

    class Recorder(pybreaker.CircuitBreakerListener):
        def state_change(self, cb, old_state, new_state):  # type: ignore[no-untyped-def]
            changes.append((old_state.name, new_state.name))

    clock = Clock()
    registry = BreakerRegistry(
        {"payments": BreakerConfig(fail_max=2, reset_timeout_s=10)},
        clock=clock,
        listeners=[Recorder()],
    )
    caplog.set_level(logging.INFO, logger="breaker")
    fail(registry, "payments", 2)
    clock.now += 10
    probe = registry.before_call("payments")
    registry.record(probe, failure=False)  # type: ignore[arg-type]
    records = [(r.levelname, r.getMessage(), r.target, r.failures) for r in caplog.records]  # type: ignore[attr-defined]
    assert records == [
        ("WARNING", "breaker opened", "payments", 2),
        ("INFO", "breaker half-open", "payments", 2),
        ("INFO", "breaker closed", "payments", 0),
    ]
    assert changes == [("closed", "open"), ("open", "half-open"), ("half-open", "closed")]


def test_operator_status_and_reset_on_a_local_registry(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    registry = make(clock)
    fail(registry, "payments", 3)
    row = status(registry, ["payments"])[0]
    assert (row.state, row.failures, row.storage) == ("open", 3, "local")
    assert row.reopens_at == datetime.fromtimestamp(T0 + 30, tz=UTC)
    caplog.set_level(logging.INFO, logger="breaker")
    reset(registry, "payments", by="alice")
    assert isinstance(registry.before_call("payments"), Allowed)
    [record] = [r for r in caplog.records if r.getMessage() == "breaker reset by operator"]
    assert (record.levelname, record.by, record.target) == ("WARNING", "alice", "payments")  # type: ignore[attr-defined]


def test_unknown_target() -> None:
    with pytest.raises(UnknownTarget):
        make(Clock()).before_call("nope")
