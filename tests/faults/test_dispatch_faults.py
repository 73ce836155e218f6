"""Faults around one dispatch, injected for real (FAULTS.md F02, F14, F15, F11, F19, budgets).

Real solo Celery worker processes, the relay thread, PostgreSQL, Redis and the sandbox over HTTP.
Every test asserts on what the sandbox counted (effects, requests), never on log lines, except
the budget tests, whose criterion is about ERROR lines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from outbox.ledger.states import Status
from tests.harness import CLOCK_LEASE, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
# Clock granularity between the sandbox's time.time() and PostgreSQL's clock_timestamp() on the
# same machine: allowed only on the early side of zero.
EARLY_S = 0.005


def posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sorted(sandbox.requests(method="POST", path=REFUNDS, key=pk(key)), key=lambda e: e["seq"])


def holds(check: Callable[[], Any], window_s: float, what: str, interval_s: float = 0.1) -> None:
    """``check`` stays true for the whole window: "nothing more happens"."""
    deadline = time.monotonic() + window_s
    while True:
        assert check(), f"no longer true: {what}"
        if time.monotonic() > deadline:
            return
        time.sleep(interval_s)


def error_lines(log: str) -> list[str]:
    # Celery's worker format: "[time: ERROR/MainProcess] message".
    return [line for line in log.splitlines() if "ERROR/" in line or "/ERROR" in line]


# -- F02: the provider committed, the response was lost ---------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        {"mode": "commit_then_drop"},
        {"mode": "commit_then_stall", "stall_s": 3},  # longer than the 1 s client timeout
        {"mode": "commit_then_502"},
        {"mode": "truncated_body"},
    ],
    ids=lambda f: f["mode"],
)
def test_committed_but_response_lost_is_parked_then_reconciled(pipe, sandbox, fault):
    key = f"f02-{fault['mode']}"
    sandbox.add_fault(method="POST", path=REFUNDS, count=1, **fault)
    pipe.start_worker("dispatcher", queues="dispatch")
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id

    op = pipe.wait_status(op_id, Status.OUTCOME_UNKNOWN.value, timeout_s=10)
    assert op.error_class == "ambiguous"
    assert len(sandbox.effects(key=pk(key))) == 1
    # Parked, not re-sent: the dispatcher and the relay's re-publishing leave it alone.
    holds(
        lambda: len(posts(sandbox, key)) == 1 and pipe.op(op_id).status == Status.OUTCOME_UNKNOWN.value,
        2.0,
        "one POST, still outcome_unknown",
    )

    pipe.start_worker("reconciler", queues="outcome_unknown")
    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=10)
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1
    assert op.result_reference == effects[0]["object_id"]
    assert pipe.attempts(op_id, "lookup")[-1].attempt_class == "succeeded"  # settled by a lookup
    assert len(posts(sandbox, key)) == 1, "the reconciler asked; it must not re-send"
    assert len(pipe.attempts(op_id, "dispatch")) == 1


# -- F15: 503 / 429 with Retry-After ----------------------------------------------------------


@pytest.mark.parametrize(
    "mode,http_date",
    [
        ("unavailable_503", False),
        ("rate_limited_429", False),
        ("rate_limited_429", True),
    ],
    ids=["503-seconds", "429-seconds", "429-http-date"],
)
def test_retry_after_is_honoured(pipe, sandbox, mode, http_date):
    key = f"f15-{mode}-{'date' if http_date else 'seconds'}"
    retry_after_s = 30.0  # runs out only when the test moves the clocks (ledger and sandbox together)
    sandbox.add_fault(
        mode=mode, method="POST", path=REFUNDS, count=2, retry_after_s=retry_after_s, retry_after_http_date=http_date
    )
    pipe.start_worker()
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id
    status = 503 if mode == "unavailable_503" else 429
    for n in (1, 2):
        att = pipe.wait_attempt_done(op_id, n)
        assert att.status_code == status, (n, att.attempt_class, att.error)
        # The Retry-After was recorded, and the retry is due no earlier than it runs out from the
        # moment the worker wrote the answer down (which is after the answer arrived).
        if http_date:
            # A whole-second HTTP-date at least 30 s ahead, parsed a moment later by the worker.
            assert retry_after_s - 0.1 <= att.retry_after_s <= retry_after_s + 1.0, att.retry_after_s
        else:
            assert att.retry_after_s == retry_after_s
        op = pipe.op(op_id)
        assert op.status == Status.NOT_DISPATCHED.value
        assert op.next_attempt_at - att.ended_at >= timedelta(seconds=att.retry_after_s - EARLY_S)
        assert len(posts(sandbox, key)) == n  # nothing sent while it waits
        sandbox.advance_clock(pipe.advance_to_due(op_id))
    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=15)

    reqs = posts(sandbox, key)
    assert [r["status"] for r in reqs] == [status, status, 200]
    assert (
        len(sandbox.effects(key=pk(key))) == 1 and op.result_reference == sandbox.effects(key=pk(key))[0]["object_id"]
    )
    attempts = pipe.attempts(op_id, "dispatch")
    assert [a.status_code for a in attempts] == [status, status, 200]
    for prev, nxt, att, att_next in zip(reqs, reqs[1:], attempts, attempts[1:]):
        # Provider side (its clock moved with the ledger's): no POST before the previous one's
        # time + Retry-After.
        assert nxt["clock_time"] - (prev["clock_time"] + retry_after_s) >= -EARLY_S, (prev, nxt)
        # Ledger side: the next attempt started after the Retry-After had run out.
        assert att_next.started_at - att.ended_at >= timedelta(seconds=att.retry_after_s - EARLY_S)


# -- F14: a worker SIGKILLed while its call is in flight ---------------------------------------


def test_worker_killed_mid_call_is_reconciled_not_resent(pipe, sandbox):
    key = "f14-kill-mid-call"
    # Commits at once, answers after 3 s: the effect exists while the worker waits for the answer.
    sandbox.add_fault(mode="commit_then_stall", stall_s=3, method="POST", path=REFUNDS, count=1)
    pipe.env.update(CLOCK_LEASE)
    victim = pipe.start_worker("victim", queues="dispatch")
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id

    # Kill inside the 1 s client timeout, so the worker never learns anything.
    wait_for(lambda: posts(sandbox, key), 10, interval_s=0.02, what="the POST at the sandbox")
    victim.kill()
    assert pipe.op(op_id).status == Status.DISPATCHING.value

    # The lease runs out; the relay's sweep parks it: the worker may have sent.
    pipe.advance_ledger_clock(pipe.lease_s)
    op = pipe.wait_status(op_id, Status.OUTCOME_UNKNOWN.value, timeout_s=8)
    assert op.waiting_for == "lookup" and op.error_class == "ambiguous" and op.lease_owner is None
    [att] = pipe.attempts(op_id, "dispatch")
    assert att.attempt_class == "pending" and att.ended_at is None

    # A fresh dispatcher (plus the relay re-publishing) must not re-send.
    pipe.start_worker("dispatcher", queues="dispatch")
    holds(
        lambda: len(posts(sandbox, key)) == 1 and pipe.op(op_id).status == Status.OUTCOME_UNKNOWN.value,
        1.5,
        "one POST, still outcome_unknown",
    )

    pipe.start_worker("reconciler", queues="outcome_unknown")
    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=10)
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    assert len(posts(sandbox, key)) == 1
    assert len(pipe.attempts(op_id, "dispatch")) == 1


# -- F11: a zombie worker writes late ----------------------------------------------------------


def _snapshot(pipe: Any, op_id: str) -> tuple[Any, ...]:
    op = pipe.op(op_id)
    return (op.status, op.result_reference, op.fencing_token, op.reason, op.result_digest)


def test_zombie_late_result_is_kept_as_stale_evidence(pipe, sandbox):
    key = "f11-zombie-mid-call"
    # The provider works 2.5 s on the first POST and then commits; the owner is frozen meanwhile.
    sandbox.add_fault(mode="latency", latency_ms=2500, method="POST", path=REFUNDS, count=1)
    pipe.env.update(CLOCK_LEASE)
    zombie = pipe.start_worker("zombie", queues="dispatch")
    pipe.start_worker("reconciler", queues="outcome_unknown")
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id

    wait_for(lambda: posts(sandbox, key), 10, interval_s=0.02, what="the POST at the sandbox")
    zombie.freeze()
    try:
        owner_token = pipe.op(op_id).fencing_token
        wait_for(lambda: sandbox.effects(key=pk(key)), 10, what="the provider to commit, its answer unread")
        # Lease expires -> sweep parks it -> the reconciler claims (token + 1) and finds the effect.
        pipe.advance_ledger_clock(pipe.lease_s)
        op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=12)
        assert op.fencing_token > owner_token
        before = _snapshot(pipe, op_id)
    finally:
        zombie.thaw()

    # The zombie wakes up inside its call and finishes it: its write must land on its attempt row only.
    att = wait_for(
        lambda: (a := pipe.attempts(op_id, "dispatch")[0]).ended_at is not None and a,
        10,
        what="the zombie's late result on its attempt row",
    )
    assert att.fencing_token == owner_token
    assert att.stale is True
    holds(lambda: _snapshot(pipe, op_id) == before, 0.5, "the operation ignores the zombie")
    # Solo pool: Celery's soft/hard time limits (2/2.5 s) are not enforced, and SIGSTOP froze the
    # whole worker anyway: the call lasted past the lease (on the ledger's clock) and the zombie did
    # write late. Only the fencing token stopped that write.
    assert zombie.proc.poll() is None and att.latency_s >= 2.5
    assert att.ended_at - att.started_at > timedelta(seconds=pipe.lease_s)
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1 and before[1] == effects[0]["object_id"]
    # Its late result is the provider's answer (read from the socket buffer after SIGCONT), or a
    # read timeout: either way evidence on its own row, never a verdict on the operation.
    assert att.attempt_class in ("succeeded", "ambiguous"), att.attempt_class
    if att.attempt_class == "succeeded":
        assert att.provider_reference == effects[0]["object_id"]
    assert len(posts(sandbox, key)) == 1


def test_zombie_sending_after_successor_is_refused_by_strict_fencing(pipe, sandbox):
    key = "f11-zombie-before-send"
    sandbox.configure(strict_fencing=True)
    pipe.env.update(CLOCK_LEASE)
    # The owner stalls between claim and send, long enough for us to freeze it there.
    zombie = pipe.start_worker(
        "zombie", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": f"dispatch.after_claim=sleep:1.5@{key}"}
    )
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id
    wait_for(
        lambda: (op := pipe.op(op_id)).status == Status.DISPATCHING.value and op.lease_owner.endswith(f":{zombie.pid}"),
        10,
        interval_s=0.02,
        what="the zombie's claim",
    )
    zombie.freeze()
    try:
        owner_token = pipe.op(op_id).fencing_token
        # Lease expiry -> reconciler: authoritative "not found" -> re-dispatch with the same key.
        pipe.advance_ledger_clock(pipe.lease_s)
        pipe.start_worker("successor")
        op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=15)
        before = _snapshot(pipe, op_id)
        [first] = posts(sandbox, key)
        assert first["status"] == 200 and int(first["fencing_token"]) == op.fencing_token > owner_token
    finally:
        zombie.thaw()

    # The zombie sends now, with its old, lower token: the provider refuses it.
    late = wait_for(
        lambda: len(reqs := posts(sandbox, key)) == 2 and reqs[1]["status"] is not None and reqs[1],
        10,
        what="the zombie's late POST",
    )
    assert int(late["fencing_token"]) == owner_token
    assert late["status"] == 409 and late["object_id"] is None
    att = wait_for(
        lambda: (a := pipe.attempts(op_id, "dispatch")[0]).ended_at is not None and a,
        10,
        what="the zombie's attempt row",
    )
    assert att.fencing_token == owner_token and att.status_code == 409 and att.stale is True
    assert "stale_token" in (att.error or ""), att.error
    holds(lambda: _snapshot(pipe, op_id) == before, 0.5, "the operation ignores the zombie")
    assert len(sandbox.effects(key=pk(key))) == 1


# -- F19: the same doorbell, many times -------------------------------------------------------


def test_doorbell_rung_ten_times_by_two_publishers_claims_once(pipe, sandbox):
    from workers.engine.doorbell import Doorbell
    from workers.wiring.celery_app import make_app

    key = "f19-doorbell"
    w1, w2 = pipe.start_worker("w1"), pipe.start_worker("w2")
    # No relay: the only doorbells are ours.
    op_id = pipe.submit(key).operation_id
    publishers = [Doorbell(make_app(pipe.settings())) for _ in range(2)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def ring(bell: Any) -> None:
        try:
            barrier.wait(5)
            for _ in range(5):
                bell.ring_dispatch([op_id])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ring, args=(bell,)) for bell in publishers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors

    pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=10)
    # Every doorbell was consumed (the workers ran all ten tasks), none claimed a second time.
    wait_for(
        lambda: w1.log().count("Task outbox.dispatch[") + w2.log().count("Task outbox.dispatch[") >= 20,
        10,
        what="ten doorbells received and finished",
    )
    assert len(pipe.attempts(op_id, "dispatch")) == 1
    assert pipe.op(op_id).fencing_token == 1
    assert len(sandbox.effects(key=pk(key))) == 1
    assert len(posts(sandbox, key)) == 1


# -- budgets and ERROR lines --------------------------------------------------------------------


def test_budget_spent_on_503s_fails_before_commit_with_one_error_line(pipe, sandbox):
    key = "budget-503"
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={
                "payments.refund.create": action(
                    REFUNDS,
                    decimal_args=["amount"],
                    budget={"max_attempts": 3, "deadline_s": 600, "base_delay_s": 20, "max_delay_s": 60},
                ),
            },
        )
    )
    sandbox.add_fault(mode="unavailable_503", method="POST", path=REFUNDS)  # no count: always down
    pipe.env.update(CLOCK_LEASE)
    worker = pipe.start_worker()
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id
    for n in (1, 2):  # the back-off before attempts 2 and 3: moved to, not waited for
        pipe.wait_attempt_done(op_id, n)
        pipe.advance_to_due(op_id)
    op = pipe.wait_status(op_id, Status.FAILED_BEFORE_COMMIT.value, timeout_s=15)

    assert [r["status"] for r in posts(sandbox, key)] == [503, 503, 503]
    assert sandbox.effects(key=pk(key)) == []
    assert op.attempt_count == 3 and "budget spent" in op.reason
    holds(lambda: len(posts(sandbox, key)) == 3, 0.5, "no attempt past the budget")
    errors = wait_for(lambda: error_lines(worker.log()), 5, what="the final ERROR line")
    assert len(errors) == 1, errors
    assert "failed_before_commit" in errors[0]


def test_transient_failures_that_recover_log_no_error(pipe, sandbox):
    key = "transient-503-429"
    sandbox.add_fault(mode="unavailable_503", method="POST", path=REFUNDS, count=1)
    sandbox.add_fault(mode="rate_limited_429", method="POST", path=REFUNDS, count=1, retry_after_s=30)
    worker = pipe.start_worker()
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id
    for n in (1, 2):  # the 503's backoff, then the 429's Retry-After: run out by moving the clock
        pipe.wait_attempt_done(op_id, n)
        pipe.advance_to_due(op_id)
    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=15)

    assert [r["status"] for r in posts(sandbox, key)] == [503, 429, 200]
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    log = worker.log()
    assert "retry scheduled" in log  # the blips were logged, below ERROR
    assert error_lines(log) == []
