"""Limits under faults, with real worker processes: a worker SIGKILLed while holding concurrency slots
(they come back when their lease ends), and the limits' Redis SIGKILLed and restarted mid-run (each
process keeps to its share meanwhile). The sandbox's request log judges; every intent ends once."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import redis

from outbox.ledger.states import Status
from tests.harness import REFUND_ARGS, actions_doc, fullest_window, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _posts(sandbox: Any) -> list[dict[str, Any]]:
    return sandbox.requests(path="/v1/refunds", method="POST")


def _submit(pipe: Any, prefix: str, n: int) -> list[str]:
    return [
        pipe.submit(f"{prefix}-{i:03d}", dict(REFUND_ARGS, order_id=f"{prefix}-{i}")).operation_id for i in range(n)
    ]


def _where(window: list[float], killed_at: float, back_at: float) -> str:
    """The fullest window's sends as offsets from the kill, against the outage."""
    offsets = " ".join(f"{t - killed_at:+.3f}" for t in window)
    return f"{len(window)} sends in 2 s; Redis killed at +0, back at {back_at - killed_at:+.3f}; the sends: {offsets}"


def _once_each(sandbox: Any, keys: list[str]) -> None:
    assert Counter(e["idempotency_key"] for e in sandbox.effects()) == Counter(pk(k) for k in keys)
    assert sandbox.duplicates() == []


def test_a_worker_killed_holding_slots_leaks_them_only_until_their_lease(pipe, sandbox):
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["max_in_flight"] = 2
    pipe.write_actions(doc)
    w1 = pipe.start_worker("w1")
    pipe.start_relay()
    warm = _submit(pipe, "warm", 1)  # a first good answer: w1 stops calling one at a time (its canary)
    pipe.wait_status(warm[0], Status.SUCCEEDED.value)
    sandbox.add_fault(mode="latency", method="POST", path="/v1/refunds", latency_ms=900, count=2)
    ids = _submit(pipe, "slot", 6)
    slots = pipe.env["OUTBOX_BROKER_KEY_PREFIX"].join(("agent-outbox:pacing:", ":sandbox:slots"))
    r = redis.Redis.from_url(pipe.env["OUTBOX_REDIS_URL"])
    wait_for(lambda: r.zcard(slots) == 2 and len(_posts(sandbox)) == 3, 10, what="w1 holding both slots, two calls out")
    leases_end = min(score for _, score in r.zrange(slots, 0, -1, withscores=True)) / 1e6
    w1.kill()
    killed_at = time.time()

    pipe.start_worker("w2")
    if time.time() < leases_end - 0.2:
        assert r.zcount(slots, f"({time.time() * 1e6:.0f}", "+inf") == 2, "the dead worker's slots are still held"
    wait_for(
        lambda: pipe.count(Status.SUCCEEDED.value) == 7, 40, what=lambda: f"7 succeeded (now {pipe.count('succeeded')})"
    )

    after = [p for p in _posts(sandbox) if p["time"] > killed_at]
    assert after and min(p["time"] for p in after) >= leases_end - 0.05, "nothing sent while the leaked slots held"
    # Never more than 2 calls in flight at the sandbox (arrival to answer).
    edges = sorted(
        [(p["time"], 1) for p in _posts(sandbox)] + [(p["answered"], -1) for p in _posts(sandbox) if p["answered"]]
    )
    held = peak = 0
    for _, step in edges:
        held += step
        peak = max(peak, held)
    assert peak <= 2
    _once_each(sandbox, ["warm-000"] + [f"slot-{i:03d}" for i in range(6)])
    assert {pipe.op(i).status for i in ids} == {Status.SUCCEEDED.value}


def test_redis_restarted_mid_run_each_process_keeps_to_its_share(private_redis, pipe, sandbox):
    # The limits' (and breakers') Redis is the private one; the broker stays on the shared Redis.
    pipe.env["OUTBOX_REDIS_URL"] = private_redis.url
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["rate_limit"] = {"per_s": 20, "burst": 1}
    pipe.write_actions(doc)
    pipe.start_worker("w1")
    pipe.start_worker("w2")
    pipe.start_relay()
    n = 100
    ids = _submit(pipe, "redis", n)
    live = pipe.env["OUTBOX_BROKER_KEY_PREFIX"].join(("agent-outbox:pacing:", ":processes"))
    wait_for(lambda: private_redis.client().zcard(live) == 2, 10, what="both workers counted live")
    time.sleep(0.5)  # and each has seen that count since (a process keeps the count it saw last)
    private_redis.kill()
    killed_at = time.time()
    wait_for(
        lambda: sum(p["time"] > killed_at + 1 for p in _posts(sandbox)) >= 20, 10, what="sends on the local shares"
    )
    private_redis.start()  # empty: no GCRA state, no heartbeats
    back_at = time.time()
    wait_for(
        lambda: pipe.count(Status.SUCCEEDED.value) == n,
        40,
        what=lambda: f"{n} succeeded (now {pipe.count('succeeded')})",
    )

    times = [p["time"] for p in _posts(sandbox)]
    during = [t for t in times if killed_at <= t < back_at]
    # Each of the 2 processes keeps to 10/s while Redis is away, after a pause of 1 s in which the turns
    # Redis handed out are sent: the same bound as without the outage (test_pacing_dispatch.py), and
    # over the outage as a whole, at most the limit + 5%.
    worst = fullest_window(times, 2.0, after_s=1.0)
    assert len(worst) <= 2 * 20 * 1.05, _where(worst, killed_at, back_at)
    assert len(during) <= 20 * 1.05 * (back_at - killed_at) + 1, (len(during), back_at - killed_at)
    _once_each(sandbox, [f"redis-{i:03d}" for i in range(n)])
    assert {pipe.op(i).status for i in ids} == {Status.SUCCEEDED.value}
    assert {pipe.op(i).attempt_count for i in ids} == {1}
