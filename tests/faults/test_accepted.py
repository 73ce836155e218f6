"""Accepted is not completed: a provider that takes a request and finishes it (or fails it) later.

The sandbox creates every object ``pending`` (answering 200 with that status, or 202) and settles
it once its clock has moved past ``processing_s``; objects whose key matches ``processing_fails``
end ``failed``. On top: the answer of some first requests is lost after the commit, and a worker
is killed between the provider's answer and the ledger's write. What must hold, counted at the
sandbox: while the provider processes, no operation is ``succeeded`` (they wait in ``accepted``,
never sent again); once it finishes, each ends ``succeeded`` or ``failed_at_provider`` exactly as the
provider's object did, never ``failed_before_commit``, with one object per key.

Real Celery worker processes, the relay, PostgreSQL, Redis and the sandbox over HTTP.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.faults.test_dispatch_faults import error_lines, holds
from tests.harness import CLOCK_LEASE, FAST_LOOKUPS, REFUND_ARGS, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

N = 12
PROCESSING_S = 300  # the sandbox's clock is moved past it; nothing finishes by waiting


def _keys() -> list[str]:
    # Every third one fails at the provider after it was accepted.
    return [f"acc-{'fail' if i % 3 == 0 else 'ok'}-{i}" for i in range(N)]


@pytest.mark.parametrize("accept_status", [200, 202])
def test_accepted_waits_for_the_provider_and_ends_as_the_provider_says(pipe, sandbox, accept_status: int):
    sandbox.configure(processing_s=PROCESSING_S, processing_status=accept_status, processing_fails="*acc-fail-*")
    pipe.write_actions(actions_doc(sandbox.url, actions={"payments.refund.create": action("/v1/refunds")}))
    keys = _keys()
    # The answer to the first request of two keys is lost after the provider committed it.
    for key in keys[1:3]:
        sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", key_pattern=pk(key), count=1)
    # A worker dies between the provider's answer and the ledger's write, for one key.
    pipe.env.update(CLOCK_LEASE)
    doomed = pipe.start_worker(
        "doomed", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": f"dispatch.after_response=exit@{keys[4]}"}
    )
    ops = {key: pipe.submit(key, dict(REFUND_ARGS)).operation_id for key in keys}
    pipe.start_relay()
    wait_for(lambda: doomed.proc.poll() is not None, 20, what="the doomed worker dies at its failpoint")
    pipe.start_worker("w1", queues="dispatch,outcome_unknown", extra_env=FAST_LOOKUPS)
    pipe.advance_ledger_clock(pipe.lease_s + 1)  # the leases of what it held run out

    # The provider has every one of them, pending: none is succeeded, none is sent again.
    wait_for(
        lambda: Counter(pipe.op(op).status for op in ops.values()) == Counter({"accepted": N}),
        30,
        what=lambda: f"all accepted (now {Counter(pipe.op(op).status for op in ops.values())})",
    )
    for key, op_id in ops.items():
        op = pipe.op(op_id)
        assert op.waiting_for == "provider" and op.result_reference, (key, op.reason)
    posts = Counter(r["idempotency_key"] for r in sandbox.requests(method="POST", path="/v1/refunds"))
    holds(
        lambda: (
            all(pipe.op(op).status == "accepted" for op in ops.values())
            and Counter(r["idempotency_key"] for r in sandbox.requests(method="POST", path="/v1/refunds")) == posts
        ),
        2.0,
        "accepted operations wait for the provider, looked up, never sent again",
    )
    assert all(e["status"] == "pending" for e in sandbox.effects())

    sandbox.advance_clock(PROCESSING_S + 1)  # the provider finishes: done, or failed
    wait_for(
        lambda: all(pipe.op(op).status in ("succeeded", "failed_at_provider") for op in ops.values()),
        30,
        what=lambda: f"settled (now {Counter(pipe.op(op).status for op in ops.values())})",
    )
    for key, op_id in ops.items():
        effects = sandbox.effects(key=pk(key))
        assert len(effects) == 1, (key, effects)  # one object per key, whatever was lost or killed
        op = pipe.op(op_id)
        expected = "failed_at_provider" if effects[0]["status"] == "failed" else "succeeded"
        assert op.status == expected, (key, op.status, effects[0]["status"], op.reason)
        assert op.result_reference == effects[0]["object_id"]
    assert sum(pipe.op(op).status == "failed_at_provider" for op in ops.values()) == N // 3
    assert sandbox.duplicates() == []
    # A provider-side failure is a final failure (ERROR); nothing else of this is.
    w1 = next(w for w in pipe.workers if w.name == "w1")
    assert all("failed_at_provider" in line for line in error_lines(w1.log())), error_lines(w1.log())
