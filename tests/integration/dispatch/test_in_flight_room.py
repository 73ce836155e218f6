"""Room in a worker process: a doorbell claims as many operations as fit, not a whole batch or none.

bench.overload found the fleet settling 43/s where its provider's latency and OUTBOX_MAX_IN_FLIGHT
allowed ~200/s: with room for exactly one batch, a doorbell waited until the whole previous batch had
finished, so one stalled call of ten held the process idle behind it. Real worker runtime in this
process, the sandbox as provider; effects counted there.
"""

from __future__ import annotations

import pytest

from tests.harness import REFUND_ARGS, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

STALL_MS = 8000  # under the target timeout below (which the time limits and the lease bound)


def test_a_stalled_call_does_not_keep_the_rest_of_the_room_idle(pipe, sandbox):
    from workers.wiring.runtime import build_runtime

    pipe.write_actions(
        actions_doc(
            sandbox.url,
            timeout_s=10,
            actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"])},
        )
    )
    pipe.env.update(
        {
            "OUTBOX_MAX_IN_FLIGHT": "4",
            "OUTBOX_DOORBELL_BATCH": "4",
            "OUTBOX_SOFT_TIME_LIMIT_S": "11",
            "OUTBOX_TIME_LIMIT_S": "13",
            "OUTBOX_LEASE_S": "15",
        }
    )
    sandbox.add_fault(mode="latency", latency_ms=STALL_MS, method="POST", key_pattern="*slow*")
    warm = pipe.submit("k-warm", dict(REFUND_ARGS, order_id="o-warm")).operation_id
    rt = build_runtime(pipe.settings())
    try:
        # A process's first call to a target is a canary, alone (dispatch/in_flight.py): answered
        # well, the target's calls overlap.
        rt.dispatcher.dispatch([warm])
        assert pipe.op(warm).status == "succeeded"
        slow = pipe.submit("k-slow", dict(REFUND_ARGS, order_id="o-slow")).operation_id
        first = [slow] + [pipe.submit(f"k-a{i}", dict(REFUND_ARGS, order_id=f"o-a{i}")).operation_id for i in range(3)]
        rt.dispatcher.dispatch(first, wait=False)
        wait_for(lambda: all(pipe.op(i).status == "succeeded" for i in first[1:]), 10, what="the three fast calls")
        assert pipe.op(slow).status == "dispatching"  # still out: it holds one of the four places
        second = [pipe.submit(f"k-b{i}", dict(REFUND_ARGS, order_id=f"o-b{i}")).operation_id for i in range(4)]
        rt.dispatcher.dispatch(second, wait=False)
        # Three places are free: three of the four are claimed and sent now, not after the stall.
        wait_for(
            lambda: sum(pipe.op(i).status == "succeeded" for i in second) == 3,
            STALL_MS / 1000 / 2,
            what="three of the second doorbell's operations sent while the stalled call is out",
        )
        assert pipe.op(slow).status == "dispatching"
        left = [i for i in second if pipe.op(i).status == "not_dispatched"]
        assert len(left) == 1  # no room for it: it stays due for the next doorbell
        wait_for(lambda: pipe.op(slow).status == "succeeded", 10, what="the stalled call answered")
        rt.dispatcher.dispatch(left)
    finally:
        rt.close()
    every = [warm, *first, *second]
    assert all(pipe.op(i).status == "succeeded" for i in every)
    for i in every:
        assert len(sandbox.effects(key=pipe.op(i).provider_key)) == 1
    assert sandbox.duplicates() == []
    assert pk("k-slow") in {p["idempotency_key"] for p in sandbox.requests(method="POST")}
