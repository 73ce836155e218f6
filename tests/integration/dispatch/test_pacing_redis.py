"""Limits shared through a real Redis: GCRA turns and concurrency slots across processes' pacers, per
tenant x target, a dead holder's slot freed by its lease, and each process's share while Redis is
away (a redis-server of the test's own, SIGKILLed and restarted). Each test has its own namespace."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.harness import PrivateRedis
from workers.ground import metrics
from workers.pacing import Cleared, Deferred, Pacer, Rate, TargetLimits
from workers.pacing.limits import Ask
from workers.pacing.local import LocalPacing
from workers.pacing.shared import KEY_PREFIX, RedisPacing

pytestmark = pytest.mark.redis


@pytest.fixture
def namespace(redis_url: str) -> Iterator[str]:
    ns = f"test-{uuid.uuid4().hex[:8]}"
    yield ns
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{KEY_PREFIX}:{ns}:*"))
    if keys:
        r.delete(*keys)


def limits(**kw: Any) -> dict[str, TargetLimits]:
    return {"pay": TargetLimits("pay", kw.get("rate"), kw.get("slots"), kw.get("tenants", {}), call_s=1.0)}


class Sleeps:
    """Records the waits a pacer would sleep, without sleeping (Redis's clock still runs)."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(seconds)


def _burst(redis_url: str, namespace: str) -> tuple[float, list[float], list[bool]]:
    """Two processes' pacers (one namespace), three threads each: 30 calls at 50/s with a burst of 5.
    Returns the start, each call's send time (sorted), and whether each went without waiting."""
    pacers = [
        Pacer(limits(rate=Rate(50, 5)), process_id=f"p{i}", redis_url=redis_url, namespace=namespace) for i in (1, 2)
    ]
    sent: list[float] = []
    at_once: list[bool] = []
    lock = threading.Lock()

    def calls(pacer: Pacer) -> None:
        for _ in range(5):
            cleared = pacer.clear("pay", "t", max_wait_s=1.0)
            assert isinstance(cleared, Cleared)
            with lock:
                sent.append(time.monotonic())
                at_once.append(cleared.waited_for is None)

    threads = [threading.Thread(target=calls, args=(p,)) for p in pacers for _ in range(3)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in pacers:
        p.close()
    return start, sorted(sent), at_once


def test_a_burst_goes_at_once_then_the_rate_holds_across_processes(redis_url: str, namespace: str) -> None:
    # Six threads wait for turns 20 ms apart, so no gap between two sends is longer than that unless
    # this process stalled (a shared CI machine once held it 0.6 s in the burst): such a run says
    # nothing of the pacer and is run again, at most twice. A pacer that leaves gaps fails every run.
    for attempt in range(3):
        start, sent, at_once = _burst(redis_url, f"{namespace}:{attempt}")
        if max(b - a for a, b in zip(sent, sent[1:])) <= 0.1:
            break
    # The burst goes without waiting (a call whose thread was scheduled late may find its turn come too).
    assert sum(at_once) >= 5 and sent[4] - sent[0] < 0.1
    # Each turn after the burst is one interval (20 ms) after the last: call i never before (i - 4) x 20 ms.
    early = [(i, round(t - start, 3)) for i, t in enumerate(sent) if t - start < (i - 4) * 0.02 - 0.002]
    assert early == []
    assert 0.48 <= sent[-1] - start < 0.7  # 25 turns of 20 ms: ~50/s, not slower


def test_a_tenant_is_held_to_its_own_rate_and_the_targets(redis_url: str, namespace: str) -> None:
    sleeps = Sleeps()
    pacer = Pacer(
        limits(rate=Rate(100, 100), tenants={"acme": Rate(5, 1)}),
        process_id="p1",
        redis_url=redis_url,
        namespace=namespace,
        sleep=sleeps,
    )
    assert isinstance(pacer.clear("pay", "acme", max_wait_s=1.0), Cleared)
    second = pacer.clear("pay", "acme", max_wait_s=1.0)  # acme's next turn is 0.2 s later: reserved, slept
    assert isinstance(second, Cleared) and sleeps.slept and 0.15 < sleeps.slept[0] <= 0.2
    assert second.note() is not None and "rate limit of tenant acme at target pay: 5/s" in second.note()  # type: ignore[operator]
    third = pacer.clear("pay", "acme", max_wait_s=0.05)
    assert isinstance(third, Deferred) and third.why == "rate limit of tenant acme at target pay: 5/s"
    assert 0.3 < third.wait_s <= 0.4 * 1.5  # two turns away, plus up to half of it as jitter
    # Another tenant: only the target's 100/s, which has room.
    assert pacer.clear("pay", "beta", max_wait_s=0.0) == Cleared("pay", None, "redis", 0.0, None)
    pacer.close()


def test_concurrency_slots_are_shared_and_a_dead_holders_slot_is_freed_by_its_lease(
    redis_url: str, namespace: str
) -> None:
    one, two = (Pacer(limits(slots=2), process_id=f"p{i}", redis_url=redis_url, namespace=namespace) for i in (1, 2))
    a, b = one.clear("pay", "t", max_wait_s=1.0), one.clear("pay", "t", max_wait_s=1.0)
    assert isinstance(a, Cleared) and isinstance(b, Cleared) and a.holder and b.holder
    full = two.clear("pay", "t", max_wait_s=0.1)  # the other process finds no slot, waits briefly, goes back
    assert isinstance(full, Deferred) and full.limit == "concurrency"
    one.done(a)
    c = two.clear("pay", "t", max_wait_s=0.1)
    assert isinstance(c, Cleared) and c.storage == "redis"
    # A holder that never gives its slot back (a killed worker) holds it only until its lease ends.
    store = RedisPacing(redis.Redis.from_url(redis_url), namespace, "p3")
    ask = Ask("lease", [], 1, "dies", 1.0, 0.3)
    assert store.acquire(ask).go
    assert store.acquire(Ask("lease", [], 1, "next", 0.0, 0.3)).limit == "concurrency"
    assert store.reading("lease").in_flight == 1
    time.sleep(0.35)
    assert store.acquire(Ask("lease", [], 1, "next", 0.0, 0.3)).go
    for p in (one, two):
        p.close()


def test_redis_away_each_process_keeps_to_its_share_then_the_fleet_shares_again(
    private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.pacing.pacer")

    def pacer(name: str, sleeps: Sleeps) -> Pacer:
        return Pacer(
            limits(rate=Rate(20, 4)),
            process_id=name,
            redis_url=private_redis.url,
            redis_retry_s=0.05,
            sleep=sleeps,
        )

    a_sleeps = Sleeps()
    a, b = pacer("a", a_sleeps), pacer("b", Sleeps())
    for p in (a, b, a):  # both seen live: a's last call counts two processes
        assert isinstance(p.clear("pay", "t", max_wait_s=1.0), Cleared)
    private_redis.kill()
    a_sleeps.slept.clear()
    got = [a.clear("pay", "t", max_wait_s=1.0) for _ in range(3)]
    # Its share: half of 20/s with half the burst of 4 (10/s, two at once), after a pause of 1 s that
    # lets the turns Redis handed out go first: two go at 1 s, the third's turn (1.1 s) is too far.
    assert [type(c) for c in got] == [Cleared, Cleared, Deferred]
    assert all(c.storage == "local" for c in got[:2])  # type: ignore[union-attr]
    assert [round(s, 1) for s in a_sleeps.slept] == [1.0, 1.0]
    assert got[2].why == "rate limit of target pay: 20/s (this process keeps to 1/2 while Redis is away)"  # type: ignore[union-attr]
    assert a.degraded and metrics.PROCESS_REGISTRY.get_sample_value("outbox_pacing_fallback") == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1/2 of every limit" in warnings[0].getMessage()
    # A process that never saw a count keeps to 1/OUTBOX_PACING_FALLBACK_PROCESSES (4): 5/s, burst 1.
    c = pacer("c", Sleeps())
    asked = time.monotonic()
    assert isinstance(c.clear("pay", "t", max_wait_s=1.0), Cleared)
    second = c.clear("pay", "t", max_wait_s=1.0)
    # Its turn: 0.2 s after the first's, which came 1 s after c found Redis away (after ``asked``).
    # Its sleeps are not real, time is: the wait is counted from the second ask (13 ms after the first
    # on a loaded CI machine, so no fixed bound).
    assert isinstance(second, Deferred) and second.wait_s >= 1.2 - (time.monotonic() - asked)

    private_redis.start()
    time.sleep(0.06)  # one retry interval: the next call tries Redis again
    a_sleeps.slept.clear()
    back = a.clear("pay", "t", max_wait_s=1.0)
    assert not a.degraded
    # Back on Redis (empty after its restart), no turn comes before the local ones have gone: its own
    # (1 s ahead at most) and those of the processes still on their shares until their next try
    # (redis_retry_s, 0.05 s, later at most): longer than a call waits in its thread, so the call
    # goes back to the ledger until then (plus its jitter, 5% at most).
    assert isinstance(back, Deferred) and back.limit == "rate" and 1.0 < back.wait_s <= 1.05 * 1.05
    assert back.why.startswith("rate limit of target pay: 20/s (Redis is back from an outage: its first turns come ")
    assert a_sleeps.slept == []
    assert metrics.PROCESS_REGISTRY.get_sample_value("outbox_pacing_fallback") == 0
    assert any(r.levelno == logging.INFO and "outage over" in r.getMessage() for r in caplog.records)
    # One WARNING per process for the whole outage (c's names its own share), none per call.
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "1/2 of" in warned[0] and "1/4 of" in warned[1]
    for p in (a, b, c):
        p.close()


def test_a_call_held_by_the_switch_pause_is_sent_back_to_its_turn_not_before(redis_url: str, namespace: str) -> None:
    # Just back from an outage (no turn before 1.5 s), on an empty rate with a burst: a call that may
    # wait less than the pause is sent back to the pause's end, on both limiters (Redis's once
    # answered a script error here, and the process went back to its share on every try).
    scope = limits(rate=Rate(20, 4))["pay"].scopes_for("t")
    ask = Ask("pay", scope, None, "", 0.2, 1.0, not_before_s=1.5)
    for limiter in (RedisPacing(redis.Redis.from_url(redis_url), namespace, "p1"), LocalPacing()):
        first, second = limiter.acquire(ask), limiter.acquire(ask)
        assert not first.go and first.limit == "rate" and 1.49 <= first.wait_s <= 1.5
        # The next one sent back queues one interval (0.05 s) behind it.
        assert not second.go and 1.54 <= second.wait_s <= 1.55


def test_with_no_limit_declared_a_call_costs_no_redis_round_trip(private_redis: PrivateRedis) -> None:
    client = private_redis.client()
    pacer = Pacer(limits(rate=Rate(100, 10)), process_id="p1", redis_url=private_redis.url)

    def scripts_run() -> int:
        stats = client.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

    before = scripts_run()
    for _ in range(50):
        assert pacer.clear("other", "t", max_wait_s=1.0) == Cleared("other")
    assert scripts_run() == before
    pacer.clear("pay", "t", max_wait_s=1.0)
    assert scripts_run() > before  # the count does see a limited call's round trip
    pacer.close()


def test_calls_sent_back_queue_up_at_the_rate_across_processes(redis_url: str, namespace: str) -> None:
    # 10/s, a burst of 2, nobody may wait: two go, the rest are sent back to come back one turn
    # after another (0.1 s apart), whichever process asked: a backlog returns at the rate.
    pacers = [
        Pacer(limits(rate=Rate(10, 2)), process_id=f"p{i}", redis_url=redis_url, namespace=namespace, rng=lambda: 0.0)
        for i in (1, 2)
    ]
    answers = [pacers[i % 2].clear("pay", "t", max_wait_s=0.0) for i in range(8)]
    assert [isinstance(a, Cleared) for a in answers] == [True, True] + [False] * 6
    waits = [a.wait_s for a in answers[2:] if isinstance(a, Deferred)]
    gaps = [b - a for a, b in zip(waits, waits[1:])]
    assert gaps == pytest.approx([0.1] * 5, abs=0.01), waits
    assert waits[0] == pytest.approx(0.1, abs=0.02)  # the first one back at the first free turn


def test_calls_sent_back_wait_in_their_tenants_line_not_behind_another_tenants_backlog(
    redis_url: str, namespace: str
) -> None:
    # 10/s, a burst of 2: big's backlog is sent back in a line 0.1 s apart across processes; small's
    # one call comes back at the first free turn, and big's next stays in big's own line.
    pacers = [
        Pacer(limits(rate=Rate(10, 2)), process_id=f"p{i}", redis_url=redis_url, namespace=namespace, rng=lambda: 0.0)
        for i in (1, 2)
    ]
    big = [pacers[i % 2].clear("pay", "big", max_wait_s=0.0) for i in range(8)]
    waits = [a.wait_s for a in big if isinstance(a, Deferred)]
    assert len(waits) == 6 and waits[-1] == pytest.approx(0.6, abs=0.03), waits
    small = pacers[1].clear("pay", "small", max_wait_s=0.0)
    assert isinstance(small, Deferred) and small.wait_s == pytest.approx(0.1, abs=0.03)
    nxt = pacers[0].clear("pay", "big", max_wait_s=0.0)
    assert isinstance(nxt, Deferred) and nxt.wait_s == pytest.approx(waits[-1] + 0.1, abs=0.03)


def test_a_tenant_holds_only_its_share_of_the_turns_ahead_across_processes(redis_url: str, namespace: str) -> None:
    # 5/s, no burst; the calls "sleep" without sleeping, so each holds its turn (Redis's clock runs:
    # turns 0.2 s apart leave room for a slow machine's round trips). big alone holds the next 0.8 s's
    # turns (4) across two processes; its next call (its turn 1 s away) goes back to its line. small,
    # holding none, takes that turn in its thread. 0.3 s on, big holds 3 turns of its share of 2
    # (two tenants): sent back though its turn is within its wait.
    sleeps = [Sleeps(), Sleeps()]
    pacers = [
        Pacer(
            limits(rate=Rate(5, 1)),
            process_id=f"p{i}",
            redis_url=redis_url,
            namespace=namespace,
            sleep=sleeps[i],
            rng=lambda: 0.0,
        )
        for i in (0, 1)
    ]
    big = [pacers[i % 2].clear("pay", "big", max_wait_s=1.0) for i in range(6)]
    assert [isinstance(c, Cleared) for c in big] == [True] * 5 + [False], big
    assert 0.9 < big[5].wait_s <= 1.0
    assert isinstance(pacers[1].clear("pay", "small", max_wait_s=1.0), Cleared)
    assert 0.8 < sleeps[1].slept[-1] <= 1.0
    time.sleep(0.3)
    later = pacers[0].clear("pay", "big", max_wait_s=1.0)
    assert isinstance(later, Deferred) and later.wait_s < 1.0, later
    for p in pacers:
        p.close()
