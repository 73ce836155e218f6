"""Breakers shared through the real Redis server, across real OS processes.

Each test gets its own namespace (uuid), so keys never collide with other runs, and deletes
its keys afterwards. The Redis server itself is never stopped: the "Redis goes away" test
puts a TCP proxy we own in front of it and shuts the proxy down.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from breaker import Allowed, BreakerConfig, BreakerRegistry, Open, reset, status
from breaker.storage import KEY_PREFIX
from tests.harness import advance_breaker_clock

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[3]

# Runs in a child process: fail `fail_n` times, then optionally race `threads` callers for the
# half-open probe: it says it is ready (INCR `ready`), waits for the go (BLPOP `go`), races, says
# its callers have decided (INCR `decided`); a child that won holds the probe until all `racers`
# have decided and then records `outcome`. Prints what it saw as JSON.
CHILD = r"""
import json, sys, threading, time
import redis
from breaker import Allowed, BreakerConfig, BreakerRegistry
a = json.loads(sys.argv[1])
cfg = BreakerConfig(fail_max=a["fail_max"], reset_timeout_s=a["reset_s"])
reg = BreakerRegistry({a["target"]: cfg}, redis_url=a["url"], namespace=a["ns"])
for _ in range(a.get("fail_n", 0)):
    d = reg.before_call(a["target"])
    if isinstance(d, Allowed):
        reg.record(d, failure=True)
decisions = []
if a.get("threads"):
    sync = redis.Redis.from_url(a["url"])
    barrier = threading.Barrier(a["threads"])
    def call():
        barrier.wait()
        decisions.append(reg.before_call(a["target"]))
    sync.incr(a["ready"])
    assert sync.blpop([a["go"]], timeout=15), "no go"
    ts = [threading.Thread(target=call) for _ in range(a["threads"])]
    [t.start() for t in ts]; [t.join() for t in ts]
    sync.incr(a["decided"])
    probes = [d for d in decisions if isinstance(d, Allowed) and d.probe]
    if probes:
        deadline = time.monotonic() + 15
        while int(sync.get(a["decided"]) or 0) < a["racers"] and time.monotonic() < deadline:
            time.sleep(0.005)
        reg.record(probes[0], failure=a["outcome"] == "failure")
final = reg.before_call(a["target"])
deadline = time.monotonic() + 5
while a.get("await_open") and isinstance(final, Allowed) and time.monotonic() < deadline:
    time.sleep(0.01)  # the other process's failures may still be on their way
    final = reg.before_call(a["target"])
print(json.dumps({
    "probes": sum(1 for d in decisions if isinstance(d, Allowed) and d.probe),
    "allowed_plain": sum(1 for d in decisions if isinstance(d, Allowed) and not d.probe),
    "final": type(final).__name__, "degraded": reg.degraded,
}))
"""


def spawn(**args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.fixture()
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Redis not reachable at {REDIS_URL}: {exc}")
    yield client
    client.close()


@pytest.fixture()
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    ns = f"test-{uuid.uuid4().hex}"
    yield ns
    keys = list(redis_client.scan_iter(f"{KEY_PREFIX}:{ns}:*"))
    if keys:
        redis_client.delete(*keys)


def registry(ns: str, *, fail_max: int = 4, reset_s: float = 30, url: str = REDIS_URL, **kw: object) -> BreakerRegistry:
    config = BreakerConfig(fail_max=fail_max, reset_timeout_s=reset_s)
    return BreakerRegistry({"payments": config, "crm": config}, redis_url=url, namespace=ns, **kw)  # type: ignore[arg-type]


def fail(reg: BreakerRegistry, target: str, n: int) -> None:
    for _ in range(n):
        decision = reg.before_call(target)
        assert isinstance(decision, Allowed)
        reg.record(decision, failure=True)


def wait_until(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


def test_failures_from_two_processes_add_up_and_both_see_open(namespace: str) -> None:
    args = dict(url=REDIS_URL, ns=namespace, target="payments", fail_max=4, reset_s=30, fail_n=2, await_open=True)
    first, second = spawn(**args), spawn(**args)
    results = [result(first), result(second)]
    # The last of the 4 counted failures opened the breaker; each child then saw Open.
    assert [r["final"] for r in results] == ["Open", "Open"]
    local = registry(namespace)
    [row] = status(REDIS_URL, ["payments"], namespace=namespace)
    assert (row.state, row.failures, row.storage) == ("open", 4, "redis")
    decision = local.before_call("payments")
    assert isinstance(decision, Open) and decision.reopens_at == row.reopens_at
    assert row.opened_at is not None and (row.reopens_at - row.opened_at).total_seconds() == 30  # type: ignore[operator]


def test_a_registry_created_later_does_not_reset_shared_state(namespace: str) -> None:
    early = registry(namespace)
    fail(early, "payments", 3)
    late = registry(namespace)  # a worker process starting up (pybreaker#26)
    assert late.status(["payments"])[0].failures == 3
    fail(late, "payments", 1)
    assert isinstance(early.before_call("payments"), Open)
    registry(namespace)
    assert isinstance(late.before_call("payments"), Open)


def test_targets_and_namespaces_do_not_share_state(namespace: str, redis_client: redis.Redis) -> None:
    other_ns = f"{namespace}-other"
    try:
        reg, other = registry(namespace), registry(other_ns)
        fail(reg, "payments", 4)
        assert isinstance(reg.before_call("payments"), Open)
        assert isinstance(reg.before_call("crm"), Allowed)  # pybreaker#88: distinct keys
        assert isinstance(other.before_call("payments"), Allowed)
        assert other.status(["payments"])[0].failures == 0
    finally:
        keys = list(redis_client.scan_iter(f"{KEY_PREFIX}:{other_ns}:*"))
        if keys:
            redis_client.delete(*keys)


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_half_open_lets_exactly_one_probe_through_across_processes(
    namespace: str, outcome: str, redis_client: redis.Redis
) -> None:
    reset_s = 30.0  # passes only when the test moves the breaker's clock
    reg = registry(namespace, reset_s=reset_s)
    fail(reg, "payments", 4)
    sync = {k: f"{KEY_PREFIX}:{namespace}:test:{k}" for k in ("ready", "go", "decided")}
    n_children, threads = 3, 8
    children = [
        spawn(
            url=REDIS_URL,
            ns=namespace,
            target="payments",
            fail_max=4,
            reset_s=reset_s,
            threads=threads,
            racers=n_children + 1,
            outcome=outcome,
            **sync,
        )
        for _ in range(n_children)
    ]
    wait_until(lambda: int(redis_client.get(sync["ready"]) or 0) == n_children, 15)
    assert isinstance(reg.before_call("payments"), Open)  # still open: nobody may probe yet
    advance_breaker_clock(REDIS_URL, namespace, "payments", reset_s)
    go = time.time()
    # Every child and this process race for the probe, each from its own threads.
    redis_client.rpush(sync["go"], *["go"] * n_children)
    barrier = threading.Barrier(threads)
    mine: list[object] = []

    def call() -> None:
        barrier.wait()
        mine.append(reg.before_call("payments"))

    racing = [threading.Thread(target=call) for _ in range(threads)]
    for t in racing:
        t.start()
    for t in racing:
        t.join()
    redis_client.incr(sync["decided"])
    my_probes = [d for d in mine if isinstance(d, Allowed)]
    if my_probes:  # hold the probe until every racer has decided
        wait_until(lambda: int(redis_client.get(sync["decided"]) or 0) == n_children + 1, 15)
        reg.record(my_probes[0], failure=outcome == "failure")
    results = [result(c) for c in children]
    assert sum(int(r["probes"]) for r in results) + len(my_probes) == 1  # type: ignore[call-overload]
    assert all(r["allowed_plain"] == 0 for r in results)
    [row] = reg.status(["payments"])
    if outcome == "success":
        assert row.state == "closed"
        assert isinstance(reg.before_call("payments"), Allowed)
        assert (
            result(spawn(url=REDIS_URL, ns=namespace, target="payments", fail_max=4, reset_s=reset_s))["final"]
            == "Allowed"
        )
    else:
        assert row.state == "open"
        # Fresh reset timeout, counted from the failed probe.
        assert row.opened_at.timestamp() >= go - 0.05  # type: ignore[union-attr]
        assert (row.reopens_at - row.opened_at).total_seconds() == reset_s  # type: ignore[operator]


def test_operator_reset_takes_effect_in_another_process(namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = registry(namespace)
    fail(reg, "payments", 4)
    assert result(spawn(url=REDIS_URL, ns=namespace, target="payments", fail_max=4, reset_s=30))["final"] == "Open"
    caplog.set_level(logging.INFO, logger="breaker")
    reset(REDIS_URL, "payments", by="alice", namespace=namespace)
    assert result(spawn(url=REDIS_URL, ns=namespace, target="payments", fail_max=4, reset_s=30))["final"] == "Allowed"
    assert isinstance(reg.before_call("payments"), Allowed)
    [record] = [r for r in caplog.records if r.getMessage() == "breaker reset by operator"]
    assert (record.levelname, record.by, record.previous_state) == ("WARNING", "alice", "open")  # type: ignore[attr-defined]
    assert redis.Redis.from_url(REDIS_URL).hget(f"{KEY_PREFIX}:{namespace}:payments:state", "reset_by") == b"alice"


def degraded_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "breaker storage" in r.getMessage()
    ]


def test_unreachable_redis_falls_back_to_local_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="breaker")
    reg = registry("unused", url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    for _ in range(3):
        decision = reg.before_call("payments")
        assert isinstance(decision, Allowed) and decision.storage == "local"
        reg.record(decision, failure=True)
    fail(reg, "payments", 1)
    assert isinstance(reg.before_call("payments"), Open)  # the local breaker still trips
    assert [r.storage for r in reg.status(["payments", "crm"])] == ["degraded", "degraded"]
    assert degraded_warnings(caplog) == ["breaker storage unreachable, using process-local breakers"]


class Proxy:
    """A TCP proxy in front of the real Redis that the test can cut, like a network failure."""

    def __init__(self, port: int = 0) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        upstream_host, upstream_port = "127.0.0.1", 6379
        url = redis.connection.parse_url(REDIS_URL)
        upstream_host, upstream_port = url.get("host", upstream_host), url.get("port", upstream_port)
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.closed:
                client.close()
                return
            server = socket.create_connection((upstream_host, upstream_port))
            self.sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def shutdown(self) -> None:
        self.closed = True
        # close() alone leaves a socket that a thread is blocked accept()ing on listening;
        # shutdown() wakes that thread and stops new connections now.
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_redis_lost_mid_life_degrades_once_and_recovers_once(namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="breaker")
    proxy = Proxy()
    clock = Clock()
    reg = registry(
        namespace,
        url=f"redis://127.0.0.1:{proxy.port}/{REDIS_URL.rsplit('/', 1)[-1] or 0}",
        clock=clock,
        redis_retry_s=5,
    )
    try:
        fail(reg, "payments", 2)
        assert reg.status(["payments"])[0].storage == "redis"
        in_flight = reg.before_call("payments")
        assert isinstance(in_flight, Allowed) and in_flight.storage == "redis"

        proxy.shutdown()
        reg.record(in_flight, failure=True)  # its Redis write fails: no exception, counted locally
        for _ in range(20):
            decision = reg.before_call("payments")
            if isinstance(decision, Allowed):
                assert decision.storage == "local"
                reg.record(decision, failure=True)
        assert isinstance(reg.before_call("payments"), Open)  # tripped locally after fail_max
        clock.now += 5
        assert isinstance(reg.before_call("crm"), Allowed)  # a retry of Redis that fails again
        assert degraded_warnings(caplog) == ["breaker storage unreachable, using process-local breakers"]

        proxy = Proxy(port=proxy.port)
        clock.now += 5
        decision = reg.before_call("payments")
        # Back on the shared breaker: it holds the 2 failures recorded before the outage.
        assert isinstance(decision, Allowed) and decision.storage == "redis"
        assert reg.status(["payments"])[0].failures == 2
        for _ in range(5):
            reg.before_call("crm")
        assert degraded_warnings(caplog) == [
            "breaker storage unreachable, using process-local breakers",
            "breaker storage reachable again, using shared breakers",
        ]
    finally:
        reg.close()
        proxy.shutdown()
