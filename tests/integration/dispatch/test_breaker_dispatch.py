"""Breakers in dispatch, end to end: real solo Celery workers, relay, PostgreSQL, Redis, sandbox.

Effects are counted by the sandbox (request log, effects ledger) and the ledger, not by log lines;
worker logs are only read to check the degraded-mode WARNING is logged once, not per call.
"""

from __future__ import annotations

import math
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from breaker import BreakerStatus, status
from outbox.ledger.clock import db_now
from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Attempt, Operation
from tests.harness import REFUND_ARGS, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

DOWN = {"mode": "unavailable_503", "method": "POST", "path": "/v1/*"}


def _actions(sandbox_url: str, *, fail_max: int, reset_s: float, max_attempts: int) -> dict[str, Any]:
    # The deadline outlasts every reset window a test moves the clocks through.
    budget = {"max_attempts": max_attempts, "deadline_s": 3600, "base_delay_s": 0.1, "max_delay_s": 0.5}
    return actions_doc(
        sandbox_url,
        breaker={"fail_max": fail_max, "reset_timeout_s": reset_s},
        actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"], budget=budget)},
    )


def _breaker(pipe: Any) -> BreakerStatus:
    return status(pipe.env["OUTBOX_REDIS_URL"], ["sandbox"], namespace=pipe.env["OUTBOX_BROKER_KEY_PREFIX"])[0]


def _submit(pipe: Any, prefix: str, n: int) -> list[str]:
    return [pipe.submit(f"{prefix}-{i}", dict(REFUND_ARGS, order_id=f"o-{i}")).operation_id for i in range(n)]


def _statuses(pipe: Any, ids: list[str]) -> Counter[str]:
    return Counter(pipe.op(i).status for i in ids)


def _why_failed(pipe: Any, ids: list[str]) -> str:
    """Each failed operation's whole history, as text (pytest shortens a list message to ~240 chars)."""
    with pipe.sessions() as s:
        out = []
        for i in ids:
            op = pipe.op(i)
            if op.status == "failed_before_commit":
                events = s.execute(
                    select(HistoryEvent.event, HistoryEvent.reason, HistoryEvent.at)
                    .where(HistoryEvent.operation_id == i)
                    .order_by(HistoryEvent.id)
                ).all()
                attempts = [
                    f"  attempt {a.attempt_number} token {a.fencing_token} {a.started_at.time()}-"
                    f"{a.ended_at and a.ended_at.time()} {a.worker} {a.attempt_class} {a.status_code} {a.error}"
                    for a in pipe.attempts(i, kind="dispatch")
                ]
                out.append(
                    "\n".join(
                        [
                            f"{i}: {op.reason} ({op.attempt_count} attempts)",
                            *(f"  {e[2].time()} {e[0]}: {e[1]}" for e in events),
                            *attempts,
                        ]
                    )
                )
        return "\n".join(out)


def _sent_by(pipe: Any, ids: list[str], after_id: int) -> Counter[str]:
    """Dispatch attempts really sent (or in flight) after attempt row ``after_id``, by worker pid."""
    with pipe.sessions() as s:
        workers = s.execute(
            select(Attempt.worker).where(
                Attempt.operation_id.in_(ids),
                Attempt.kind == "dispatch",
                Attempt.id > after_id,
                Attempt.attempt_class != "not_sent",
            )
        ).scalars()
        return Counter(w.rsplit(":", 1)[-1] for w in workers)


def _parks(pipe: Any, ids: list[str]) -> dict[str, int]:
    """Waits for the breaker per operation: parked by the gate before a claim ("breaker open"
    events), or claimed in a batch (a doorbell takes whatever is due along) and found the breaker
    open at call time (a not_sent attempt "breaker open ...", no attempt spent)."""
    with pipe.sessions() as s:
        gated = s.execute(
            select(HistoryEvent.operation_id, func.count())
            .where(HistoryEvent.operation_id.in_(ids), HistoryEvent.event == "breaker open")
            .group_by(HistoryEvent.operation_id)
        ).all()
        at_call = s.execute(
            select(Attempt.operation_id, func.count())
            .where(
                Attempt.operation_id.in_(ids),
                Attempt.attempt_class == "not_sent",
                Attempt.error.like("breaker open%"),
            )
            .group_by(Attempt.operation_id)
        ).all()
    out = {i: 0 for i in ids}
    for op_id, n in [*gated, *at_call]:
        out[op_id] += int(n)
    return out


def _assert_clean_logs(workers: list[Any]) -> None:
    for w in workers:
        text = w.log()
        assert "Traceback" not in text and "IntegrityError" not in text, text[-3000:]
        assert ": ERROR/" not in text and ": CRITICAL/" not in text, text[-3000:]


def _assert_done_once(pipe: Any, sandbox: Any, ids: list[str], max_attempts: int) -> None:
    for op_id in ids:
        op = pipe.op(op_id)
        assert op.status == "succeeded", (op.status, op.reason)
        assert 1 <= op.attempt_count <= max_attempts, (op.attempt_count, op.reason)
        # Breaker-open waits cost no budget: attempt_count counts only requests really sent. (A
        # batch claimed just before the breaker opened records its unsent calls as not_sent rows
        # "breaker open ..."; a doorbell that finds it open claims nothing and writes no row.)
        sent = [
            a
            for a in pipe.attempts(op_id, kind="dispatch")
            if not (a.attempt_class == "not_sent" and (a.error or "").startswith("breaker open"))
        ]
        assert len(sent) == op.attempt_count
        assert len(sandbox.effects(key=op.provider_key)) == 1
    assert sandbox.duplicates() == []


def _parked(pipe: Any, ids: list[str], for_s: float) -> bool:
    """Every operation waits for the breaker: not_dispatched and not due for at least ``for_s``."""
    with pipe.sessions() as s:
        waiting = s.execute(
            select(func.count())
            .select_from(Operation)
            .where(
                Operation.id.in_(ids),
                Operation.status == "not_dispatched",
                Operation.next_attempt_at > db_now(for_s),
            )
        ).scalar_one()
    return bool(waiting == len(ids))


def _where_they_stand(pipe: Any, ids: list[str], workers: list[Any]) -> str:
    """Why nothing moved: each operation's status and due time against the ledger's now, the
    shared breaker (and its probe lock), and the tail of each worker's log."""
    with pipe.sessions() as s:
        now = s.execute(select(db_now())).scalar_one()
        rows = s.execute(
            select(Operation.id, Operation.status, Operation.next_attempt_at, Operation.attempt_count).where(
                Operation.id.in_(ids)
            )
        ).all()
    client = redis.Redis.from_url(pipe.env["OUTBOX_REDIS_URL"])
    try:
        from breaker.storage import RedisBreakerStorage

        keys = RedisBreakerStorage(client, pipe.env["OUTBOX_BROKER_KEY_PREFIX"], "sandbox")
        state = {k.decode(): v.decode() for k, v in client.hgetall(keys.state_key).items()}
        redis_now = client.time()
        probe = (client.get(keys.probe_key), client.pttl(keys.probe_key))
    finally:
        client.close()
    broker = redis.Redis.from_url(pipe.env["OUTBOX_BROKER_URL"])
    try:
        queued = broker.llen(f"{pipe.env['OUTBOX_BROKER_KEY_PREFIX']}dispatch")
    finally:
        broker.close()
    ops = [f"  {r[0]} {r[1]} due in {(r[2] - now).total_seconds() if r[2] else None}s attempts {r[3]}" for r in rows]
    logs = [f"--- worker {i} ---\n{w.log()[-2500:]}" for i, w in enumerate(workers)]
    relay = pipe._relay_thread is not None and pipe._relay_thread.is_alive()
    return "\n".join(
        [
            f"ledger now {now}; redis now {redis_now}; breaker {state}; probe lock {probe}; "
            f"dispatch doorbells queued {queued}; relay thread alive {relay}",
            *ops,
            *logs,
        ]
    )


def _posts_after(sandbox: Any, seq: int) -> list[dict[str, Any]]:
    return [p for p in sandbox.requests(method="POST") if p["seq"] > seq]


def test_open_breaker_is_shared_parks_without_spending_attempts_and_recovers(pipe, sandbox):
    # The reset window is a minute: it passes only when the test moves the breaker's clock (and the
    # ledger's, where the parked operations wait for it), one window at a time.
    fail_max, reset_s, max_attempts, n = 3, 60.0, 4, 10
    pipe.write_actions(_actions(sandbox.url, fail_max=fail_max, reset_s=reset_s, max_attempts=max_attempts))
    sandbox.add_fault(**DOWN)
    workers = [pipe.start_worker(), pipe.start_worker()]
    pipe.start_relay()
    ids = _submit(pipe, "k-out", n)

    opened = wait_for(lambda: (st := _breaker(pipe)).state == "open" and st, 20, what="breaker open")
    assert opened.failures == fail_max and opened.opened_at is not None and opened.reopens_at is not None
    wait_for(lambda: _parked(pipe, ids, reset_s / 2), 20, what="every operation parked until the breaker reopens")
    # fail_max failures open it for every process; each other worker may have had one attempt
    # admitted (while closed) in flight at that moment.
    early = sandbox.requests(method="POST")
    assert fail_max <= len(early) <= fail_max + len(workers) - 1, early
    last = max(p["seq"] for p in early)

    # More than max_attempts reset windows of outage: waits that cost attempts would fail every op.
    windows = max_attempts + 1
    for window in range(1, windows + 1):
        pipe.advance_breaker_clock(reset_s)
        pipe.advance_ledger_clock(reset_s)
        # Half-open: exactly one probe reaches the sandbox (all processes together), it fails, the
        # breaker reopens and every operation parks again; nothing else is sent meanwhile.
        # 70 s: past the reset window itself. In full-suite CI runs a window has twice passed with
        # nothing sent for 20-45 s after both clocks moved (not reproduced alone; the message below
        # says where everything stood): by then the operations are due on the real clock as well.
        try:
            wait_for(
                lambda: any(p["status"] is not None for p in _posts_after(sandbox, last)), 70, what=f"probe {window}"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_where_they_stand(pipe, ids, workers)}") from None
        wait_for(
            lambda: _breaker(pipe).state == "open" and _parked(pipe, ids, reset_s / 2),
            20,
            what=lambda: f"every operation parked again after probe {window}\n{_where_they_stand(pipe, ids, workers)}",
        )
        probes = _posts_after(sandbox, last)
        assert [p["status"] for p in probes] == [503], (window, probes)
        last = probes[0]["seq"]
        assert _statuses(pipe, ids)["failed_before_commit"] == 0, _why_failed(pipe, ids)

    # Parked without a claim: each operation waited for the breaker more often than its budget.
    parks = _parks(pipe, ids)
    assert min(parks.values()) >= windows > max_attempts, parks
    assert all(pipe.op(i).attempt_count <= max_attempts for i in ids)

    # Recovery: one probe closes the breaker, every parked operation completes, one effect each.
    sandbox.clear_faults()
    pipe.advance_breaker_clock(reset_s)
    pipe.advance_ledger_clock(reset_s)
    # Operations that asked while the probe was out wait probe_wait_s (1 s) and ask again; under a
    # loaded CI machine that takes a few rounds. The message says where each one stands.
    try:
        wait_for(lambda: _statuses(pipe, ids)["succeeded"] == n, 90, what="all succeeded after recovery")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_where_they_stand(pipe, ids, workers)}") from None
    after = _posts_after(sandbox, last)
    assert Counter(p["status"] for p in after) == {200: n}, after  # one request per operation
    assert _breaker(pipe).state == "closed" and _breaker(pipe).failures == 0
    _assert_done_once(pipe, sandbox, ids, max_attempts)
    _assert_clean_logs(workers)


def test_business_rejections_never_open_the_breaker(pipe, sandbox):
    fail_max, n = 3, 20
    pipe.write_actions(_actions(sandbox.url, fail_max=fail_max, reset_s=30, max_attempts=4))
    # Two counted failures first (one short of opening), then 422 for everything: the 422s are
    # answers from a healthy downstream, so they reset the consecutive-failure count.
    sandbox.add_fault(mode="unavailable_503", method="POST", count=fail_max - 1)
    sandbox.add_fault(mode="reject_422", method="POST")
    workers = [pipe.start_worker()]
    pipe.start_relay()
    ids = _submit(pipe, "k-422", n)

    wait_for(lambda: _statuses(pipe, ids)["failed_before_commit"] == n, 30, what="all rejected")
    st = _breaker(pipe)
    assert (st.state, st.failures) == ("closed", 0)
    posts = sandbox.requests(method="POST")
    assert len(posts) == n + fail_max - 1
    assert Counter(p["status"] for p in posts) == {422: n, 503: fail_max - 1}
    assert sandbox.effects() == []
    assert _parks(pipe, ids) == {i: 0 for i in ids}
    assert "breaker opened" not in workers[0].log()


@pytest.fixture
def private_redis() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of our own for breaker state, so stopping it never touches the shared one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def up() -> bool:
        try:
            return bool(redis.Redis.from_url(url, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    try:
        wait_for(up, 10, what="private redis-server up")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


DEGRADED = "breaker storage unreachable, using process-local breakers"


def test_breaker_storage_stopped_degrades_to_local_breakers_and_loses_nothing(pipe, sandbox, private_redis):
    url, redis_proc = private_redis
    pipe.env["OUTBOX_REDIS_URL"] = url  # breaker state only; the broker stays on the shared Redis
    fail_max, reset_s, max_attempts, n = 3, 2.0, 12, 6
    pipe.write_actions(_actions(sandbox.url, fail_max=fail_max, reset_s=reset_s, max_attempts=max_attempts))
    sandbox.add_fault(**DOWN)
    workers = [pipe.start_worker(), pipe.start_worker()]
    pipe.start_relay()
    ids = _submit(pipe, "k-redis", n)
    wait_for(lambda: _breaker(pipe).state == "open", 20, what="shared breaker open")

    redis_proc.terminate()  # breaker storage stopped mid-outage
    redis_proc.wait(10)
    killed_at = time.time()
    with pipe.sessions() as s:
        before = s.execute(select(func.coalesce(func.max(Attempt.id), 0))).scalar_one()
    wait_for(lambda: all(DEGRADED in w.log() for w in workers), 20, what="every worker degraded")
    # Each worker's local breaker trips (fail_max sends) and, a reset window later, probes (one more
    # send). Process-local breakers keep their own monotonic clocks, which a test cannot move: wait
    # for those sends themselves.
    wait_for(
        lambda: all(_sent_by(pipe, ids, before)[str(w.pid)] >= fail_max + 1 for w in workers),
        30,
        what="every worker's local breaker tripped and probed",
    )

    # Local breakers still trip: at most fail_max failures per process, then one probe per process
    # per reset window (plus one attempt in flight at the switch).
    elapsed = time.time() - killed_at
    during = [p for p in sandbox.requests(method="POST") if p["time"] > killed_at]
    assert len(during) <= len(workers) * (fail_max + 1 + math.ceil(elapsed / reset_s)), (elapsed, len(during))
    assert _statuses(pipe, ids)["failed_before_commit"] == 0

    sandbox.clear_faults()
    wait_for(lambda: _statuses(pipe, ids)["succeeded"] == n, 30, what="all succeeded after recovery")
    _assert_done_once(pipe, sandbox, ids, max_attempts)
    for w in workers:
        # One WARNING on entering degraded mode, not one per call.
        assert w.log().count(DEGRADED) == 1, w.log()[-3000:]
    _assert_clean_logs(workers)


def test_a_half_open_breakers_probe_goes_to_the_operation_with_most_budget_left(pipe, sandbox):
    """One doorbell can carry operations that spent different numbers of attempts (a lagging relay
    rings several parking levels at once): the probe must not drain the one with the least left."""
    from sqlalchemy import update

    from workers.wiring.runtime import build_runtime

    reset_s = 60.0  # passes only when the test moves the breaker's clock
    pipe.write_actions(_actions(sandbox.url, fail_max=1, reset_s=reset_s, max_attempts=6))
    sandbox.add_fault(**DOWN)
    spent, fresh = _submit(pipe, "k-probe", 2)  # the spent one first: first in the table, first rung
    with pipe.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == spent).values(attempt_count=3))
    rt = build_runtime(pipe.settings())
    try:
        tripping = rt.breakers.before_call("sandbox")
        rt.breakers.record(tripping, failure=True)  # fail_max 1: open for reset_s
        assert _breaker(pipe).state == "open"
        pipe.advance_breaker_clock(reset_s)  # half-open: the first operation asked gets the probe
        outcomes = rt.dispatcher.dispatch([spent, fresh])
    finally:
        rt.close()
    assert [p["idempotency_key"] for p in sandbox.requests(method="POST")] == [pk("k-probe-1")]
    assert set(outcomes) == {spent, fresh}
    assert (pipe.op(spent).attempt_count, pipe.op(fresh).attempt_count) == (3, 1)
    assert _parks(pipe, [spent, fresh]) == {spent: 1, fresh: 0}


def test_a_probe_is_claimed_before_another_process_can_park_its_operation(pipe, sandbox):
    """CI, stop 40: with every operation due at once after a reset window, worker A was given the
    half-open probe for a fresh operation X, then spent ~25 ms parking the rest of its doorbell;
    meanwhile worker B, whose doorbell also named X, found the probe out and parked X. A's claim of
    X found it not due, the probe was given back, and the next to ask (one that had spent 3 of 4
    attempts) probed and spent its last. The gate now asks for every id before it writes anything
    and claims before it parks: here B runs at A's first park, and finds X already claimed."""
    from sqlalchemy import update

    from outbox.ledger import failpoints
    from workers.wiring.runtime import build_runtime

    reset_s = 60.0  # passes only when the test moves the breaker's clock
    pipe.write_actions(_actions(sandbox.url, fail_max=1, reset_s=reset_s, max_attempts=4))
    sandbox.add_fault(**DOWN)
    fresh, other, spent = _submit(pipe, "k-race", 3)
    with pipe.sessions.begin() as s:  # the fresh one is asked first in A's doorbell: it gets the probe
        s.execute(update(Operation).where(Operation.id == other).values(attempt_count=1))
        s.execute(update(Operation).where(Operation.id == spent).values(attempt_count=3))
    a, b = build_runtime(pipe.settings()), build_runtime(pipe.settings())
    try:
        tripping = a.breakers.before_call("sandbox")
        a.breakers.record(tripping, failure=True)  # fail_max 1: open for reset_s
        pipe.advance_breaker_clock(reset_s)  # half-open: the first operation asked gets the probe
        seen: dict[str, Any] = {}
        with failpoints.on(
            "gate.after_select_before_update", lambda _key: seen.update(b=b.dispatcher.dispatch([fresh, spent]))
        ):
            seen["a"] = a.dispatcher.dispatch([fresh, other])
    finally:
        a.close()
        b.close()
    assert "b" in seen, "A never parked: the failpoint did not run B"
    assert [p["idempotency_key"] for p in sandbox.requests(method="POST")] == [pk("k-race-0")]
    assert [pipe.op(i).attempt_count for i in (fresh, other, spent)] == [1, 1, 3]
    assert _breaker(pipe).state == "open"  # the probe failed: open again for a window
    assert all(pipe.op(i).status == "not_dispatched" for i in (fresh, other, spent))


def test_a_doorbell_that_claims_other_due_operations_asks_the_breaker_once(tmp_path, pipe, sandbox):
    """Issue 14: a doorbell whose own ids another claim took still claims whatever is due, and
    those operations had no breaker answer: each call asked Redis for itself (under the fault mix
    1.2 admissions per operation, two thirds of all claims being such fills). The claim's targets
    are asked once, as for the ids a doorbell rings. Counted on a private Redis that holds the
    breakers alone, by script: its slow log keeps every command with the SHA it ran (the broker's
    Redis transport runs scripts of its own, for its bindings: on the same Redis they made 6 and 7
    under load). Successes are told apart from admissions: they are told at most every
    SUCCESS_EVERY_S per target, so their count follows how long the ten calls took (CI, on a loaded
    machine: 8 scripts in all, which a total bound of 5 called a regression)."""
    import hashlib

    from breaker.storage import _ADMIT, _SETTLE
    from tests.harness import PrivateRedis
    from workers.dispatch.canary import SUCCESS_EVERY_S
    from workers.engine.doorbell import Doorbell
    from workers.wiring.celery_app import make_app

    admit_sha, settle_sha = (hashlib.sha1(text.encode()).hexdigest() for text in (_ADMIT, _SETTLE))
    private = PrivateRedis(tmp_path).start()
    try:
        pipe.env["OUTBOX_REDIS_URL"] = private.url
        doorbell = Doorbell(make_app(pipe.settings()))
        pipe.start_worker("w1")
        warm = pipe.submit("fill-warm").operation_id  # a new process asks before each call until one answers
        doorbell.ring_dispatch([warm])
        wait_for(lambda: pipe.op(warm).status == "succeeded", 20, what="the warm-up succeeded")
        ops = [pipe.submit(f"fill-{i}").operation_id for i in range(10)]  # no relay: nobody rings them
        redis = private.client()
        redis.config_set("slowlog-max-len", 10_000)
        redis.config_set("slowlog-log-slower-than", 0)  # every command from here on
        redis.slowlog_reset()
        rung = time.monotonic()
        doorbell.ring_dispatch(["00000000-0000-4000-8000-000000000000"])
        wait_for(lambda: {pipe.op(o).status for o in ops} == {"succeeded"}, 20, what="the fill's 10 succeeded")
        took_s = time.monotonic() - rung
        scripts = [
            entry["command"].split()[1].decode()
            for entry in redis.slowlog_get(10_000)
            if entry["command"].upper().startswith(b"EVALSHA ")
        ]
        assert len(sandbox.effects()) == 11
        # One admission for the target; the batch may be claimed in two on a loaded machine. Asking
        # per call is 10. Successes: at most one per SUCCESS_EVERY_S while the calls run, one at the
        # batch's end and the warm-up's (told after its commit was seen); telling each is 10-11.
        assert scripts.count(admit_sha) <= 2, scripts
        told = scripts.count(settle_sha)
        assert 1 <= told <= 2 + math.ceil(took_s / SUCCESS_EVERY_S), (told, took_s)
        assert set(scripts) <= {admit_sha, settle_sha}, scripts
    finally:
        pipe.stop()
        private.kill()
