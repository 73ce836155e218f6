"""The provider's "this key was first used with another request" is not "not executed" (review of issue
50, finding 7; workers/provider/classify.py KEY_CONFLICTS).

Real processes: Celery workers, the relay, PostgreSQL, Redis and the sandbox over HTTP. The first
request lands and its answer is lost; the action declares no lookup, so a person is asked, and says
"not executed" (wrongly). A deploy changed the request meanwhile, so the next attempt is another
request under the same key, which the sandbox refuses as Stripe does. That refusal used to end the
operation failed_before_commit beside the order the first request made.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from outbox.evidence.handoffs import resolve
from outbox.ledger.models import Handoff
from tests.harness import action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ORDERS = "/v1/orders"
ACTION = "orders.place"
ARGS = {"order_ref": "o-33", "amount_cents": 500, "note": "first"}


def _doc(sandbox: Any, *, deployed: bool, lookup: bool = True) -> dict[str, Any]:
    """Before the deploy: no lookup (an unknown outcome goes to a person). After it: another query and
    body mapping for the same arguments, and a lookup by the key (``lookup``) or still none."""
    if not deployed:
        return actions_doc(sandbox.url, actions={ACTION: action(ORDERS, args=list(ARGS), lookup=None)})
    changed = {"decimal_args": ["amount_cents"], "request": {"method": "POST", "path": ORDERS, "query": {"v": "2"}}}
    over = changed if lookup else changed | {"lookup": None}
    return actions_doc(sandbox.url, actions={ACTION: action(ORDERS, args=list(ARGS), **over)})


@pytest.mark.parametrize(
    "mismatch_status,lookup",
    [(409, True), (400, False)],
    ids=["sandbox-409-then-a-lookup-settles-it", "stripe-400-no-lookup-a-person"],
)
def test_a_key_refused_for_another_request_is_never_failed_beside_the_effect(pipe, sandbox, mismatch_status, lookup):
    sandbox.configure(params_mismatch_status=mismatch_status)
    key = f"k-key-conflict-{mismatch_status}"
    pipe.write_actions(_doc(sandbox, deployed=False))
    sandbox.add_fault(mode="commit_then_drop", method="POST", path=ORDERS, count=1)
    op_id = pipe.submit(key, dict(ARGS), action=ACTION).operation_id
    pipe.start_worker()
    pipe.start_relay()
    pipe.wait_status(op_id, "reconciliation_required", timeout_s=30)  # no lookup declared: a person
    assert len(sandbox.effects(key=pk(key))) == 1, "the first request landed; its answer was lost"

    for worker in pipe.workers:
        worker.stop()
    pipe.write_actions(_doc(sandbox, deployed=True, lookup=lookup))
    pipe.start_worker()
    with pipe.sessions.begin() as s:
        handoff = s.execute(select(Handoff).where(Handoff.operation_id == op_id)).scalar_one()
        resolve(s, handoff, resolution="not-executed", by="ops", note="looked in the wrong account")

    wait_for(lambda: len(pipe.attempts(op_id, "dispatch")) == 2 and pipe.op(op_id).status != "not_dispatched", 30)
    op = pipe.wait_status(op_id, "succeeded", "failed_before_commit", "reconciliation_required", timeout_s=30)
    first, refused = sorted(sandbox.requests(method="POST", key=pk(key)), key=lambda e: e["seq"])
    assert refused["query"] == "v=2" and refused["status"] == mismatch_status, refused
    assert op.status != "failed_before_commit", f"failed beside a real effect: {op.reason}"
    (effect,) = sandbox.effects(key=pk(key))
    dispatch = pipe.attempts(op_id, "dispatch")
    assert [a.attempt_class for a in dispatch] == ["ambiguous", "ambiguous"]
    assert "idempotency_error" in (dispatch[1].error or "")
    if lookup:  # the lookup by the key finds the order the first request made
        assert op.status == "succeeded" and op.result_reference == effect["object_id"], op.reason
    else:
        assert op.status == "reconciliation_required" and "no lookup declared" in op.reason, op.reason
    assert len(sandbox.requests(method="POST", key=pk(key))) == 2, "the refused request was not sent again"
