"""The pipeline end to end: real Celery worker processes, relay, PostgreSQL, Redis, sandbox."""

from __future__ import annotations

import pytest

from tests.harness import pk

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def test_intent_reaches_the_provider_once(pipe, sandbox):
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("k-happy")
    op = pipe.wait_status(r.operation_id, "succeeded")
    effects = sandbox.effects()
    assert [e["idempotency_key"] for e in effects] == [pk("k-happy")]
    assert op.result_reference == effects[0]["object_id"]


def test_commit_then_drop_is_parked_and_reconciled(pipe, sandbox):
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("k-drop")
    op = pipe.wait_status(r.operation_id, "succeeded")
    assert pipe.attempts(r.operation_id, "lookup")[-1].attempt_class == "succeeded"  # settled by a lookup
    effects = sandbox.effects()
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    # Exactly one business request was sent: the reconciler asked, it did not re-send.
    posts = sandbox.requests(method="POST", key=pk("k-drop"))
    assert len(posts) == 1


def test_one_doorbell_carries_a_batch(pipe, sandbox):
    pipe.env["OUTBOX_DOORBELL_BATCH"] = "10"
    ids = [pipe.submit(f"k-batch-{i}").operation_id for i in range(30)]
    # Publishes the 30 due ids as 3 doorbells before any worker listens. No republish while the
    # worker starts: under load its start took longer than the harness's 2 s and the relay rang
    # the still-unclaimed ids again (a lost doorbell looks the same), which this test is not about.
    pipe.start_relay(republish_after_s=600)
    worker = pipe.start_worker()
    for op_id in ids:
        pipe.wait_status(op_id, "succeeded")
    effects = sandbox.effects()
    assert sorted(e["idempotency_key"] for e in effects) == sorted(pk(f"k-batch-{i}") for i in range(30))
    received = worker.log().count("outbox.dispatch[")
    # 3 doorbells (a line for received, one for done), plus at most one per due batch rung again
    # by the relay while the worker held the last one (a held doorbell is no longer in the queue;
    # it claims whatever is due, so it is never wasted work): not 30 doorbells, one per id.
    assert received <= 2 * 10, worker.log()[-2000:]


def test_a_slow_targets_batch_is_called_concurrently_after_its_canary(pipe, sandbox):
    """A call slower than HANDOFF_S gives the calls queued behind it to threads of their own."""
    from workers.engine.in_flight import HANDOFF_S

    latency_s = 0.3
    assert latency_s > HANDOFF_S
    sandbox.add_fault(mode="latency", method="POST", latency_ms=latency_s * 1000)
    pipe.env["OUTBOX_DOORBELL_BATCH"] = "10"
    keys = [f"k-slow-{i}" for i in range(6)]
    ids = [pipe.submit(k).operation_id for k in keys]
    pipe.start_relay(republish_after_s=600)  # one doorbell with the 6 ids before the worker listens
    pipe.start_worker()
    for op_id in ids:
        pipe.wait_status(op_id, "succeeded")
    assert sorted(e["idempotency_key"] for e in sandbox.effects()) == sorted(pk(k) for k in keys)
    arrivals = sorted(r["time"] for r in sandbox.requests(method="POST"))
    assert len(arrivals) == 6
    # The canary alone, then the other five together: one after another they would arrive
    # latency_s apart (>= 1.2 s from the second to the last).
    assert arrivals[1] - arrivals[0] >= latency_s * 0.9
    assert arrivals[-1] - arrivals[1] < latency_s, arrivals
