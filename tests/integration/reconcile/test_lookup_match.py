"""Lookups by business reference verify what they adopt (issue 50, point 2), through the real pipeline:
the relay, Celery worker processes, PostgreSQL, Redis and the sandbox over HTTP.

The refunds action has no lookup by our key: it searches the order's refunds
(GET /v1/refunds?order_id=...) and tells ours apart with ``lookup.match``. The sandbox already holds
another refund of the same order, made under another key; effects are counted by the sandbox.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import select

from outbox.ledger.models import Handoff
from tests.harness import CLOCK_LEASE, REFUND_ARGS, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"


def by_order(**lookup: Any) -> dict[str, Any]:
    """The refunds action whose lookup searches by order and compares the amount and currency."""
    search = {
        "request": {"method": "GET", "path": REFUNDS, "query": {"order_id": "{order_id}"}},
        "items": "data",
        "match": {
            "order_id": "{order_id}",
            "amount": "{amount}",
            # The sandbox writes currencies lower-case ("eur" for "EUR").
            "currency": {"equals": "{currency}", "compare": "casefold"},
        },
        "authoritative_not_found": True,
        "settle_s": 0.5,
        "succeeded": ["succeeded"],
        "pending": ["pending"],
        "failed": ["failed"],
    }
    refund = action(
        REFUNDS,
        lookup=search | lookup,
        args=["order_id", "amount", "currency", "reason"],
        decimal_args=["amount"],
    )
    return {"payments.refund.create": refund}


def earlier_refund(sandbox: Any, amount: str, key: str) -> str:
    """A refund of the same order that someone else made (another key, before ours)."""
    body = {"order_id": REFUND_ARGS["order_id"], "amount": amount, "currency": "EUR", "reason": "earlier"}
    answer = httpx.post(sandbox.url + REFUNDS, json=body, headers={"Idempotency-Key": key}, timeout=5)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def refund_at_provider(sandbox: Any, object_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{sandbox.url}{REFUNDS}/{object_id}", timeout=5)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return list(sandbox.requests(method="POST", key=pk(key)))


def test_an_earlier_refund_of_the_order_is_not_adopted_then_ours_is_made_once(pipe, sandbox):
    """Lost before commit (a 500), the lookup finds only the earlier 5.00 refund of the order: not ours,
    so a not-found; authoritative after settle_s, the refund is sent again under the same key and ends
    with exactly one effect of 12.50, never called succeeded on the other refund's evidence."""
    other = earlier_refund(sandbox, "5.00", "someone-else-1")
    pipe.write_actions(actions_doc(sandbox.url, actions=by_order()))
    sandbox.add_fault(mode="fail_before_commit", method="POST", path=REFUNDS, status=500, count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("lm-other")
    op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=30)

    [ours] = sandbox.effects(key=pk("lm-other"))
    assert op.result_reference == ours["object_id"] != other
    assert refund_at_provider(sandbox, ours["object_id"])["amount"] == "12.50"
    sent = posts(sandbox, "lm-other")
    assert [p["status"] for p in sent] == [500, 200]  # re-sent once, under the same key
    lookups = pipe.attempts(r.operation_id, "lookup")
    assert lookups and all(a.provider_reference != other for a in lookups)
    assert any("none of them ours" in (a.error or "") and "amount differs" in (a.error or "") for a in lookups)
    assert len(sandbox.effects()) == 2  # the earlier refund and ours: nothing else


def test_without_an_authoritative_not_found_the_other_refund_goes_to_a_person(pipe, sandbox):
    """The same, but the search is not declared authoritative: finding only others' objects proves
    nothing, nothing is sent again, and when the reconciler's lookups are spent a person decides."""
    other = earlier_refund(sandbox, "5.00", "someone-else-2")
    pipe.write_actions(actions_doc(sandbox.url, actions=by_order(authoritative_not_found=False)))
    sandbox.add_fault(mode="fail_before_commit", method="POST", path=REFUNDS, status=500, count=1)
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "2"})
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("lm-person")
    pipe.wait_attempt_done(r.operation_id, 1)

    def handed_off() -> bool:
        pipe.advance_to_due(r.operation_id)  # each re-check is moved to, not waited for
        return pipe.op(r.operation_id).status == "reconciliation_required"

    wait_for(handed_off, 30, 0.2, what="a handoff once the lookups are spent")
    op = pipe.op(r.operation_id)
    assert op.result_reference is None and "not authoritative" in (op.reason or "")
    assert [p["status"] for p in posts(sandbox, "lm-person")] == [500]  # never re-sent
    assert sandbox.effects(key=pk("lm-person")) == []
    assert all(a.provider_reference != other for a in pipe.attempts(r.operation_id, "lookup"))


def test_two_matching_refunds_go_to_a_person_with_both_references(pipe, sandbox):
    """An earlier refund of the same order and the same amount, and ours, whose answer was lost after
    commit: both pass the match, so neither is adopted; a person decides at once (no lookups spent
    waiting), and the handoff packet names both."""
    other = earlier_refund(sandbox, REFUND_ARGS["amount"], "someone-else-3")
    pipe.write_actions(actions_doc(sandbox.url, actions=by_order()))
    sandbox.add_fault(mode="commit_then_drop", method="POST", path=REFUNDS, count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("lm-twins")
    op = pipe.wait_status(r.operation_id, "reconciliation_required", timeout_s=30)

    [ours] = sandbox.effects(key=pk("lm-twins"))
    assert op.result_reference is None
    assert len(pipe.attempts(r.operation_id, "lookup")) == 1  # one look was enough to know
    assert [p["status"] for p in posts(sandbox, "lm-twins")] == ["reset"]  # never re-sent
    with pipe.sessions() as s:
        packet = s.execute(select(Handoff).where(Handoff.operation_id == op.id)).scalar_one().packet
    assert sorted(packet["candidates"]) == sorted([other, ours["object_id"]])
    assert other in packet["next_step"] and ours["object_id"] in packet["next_step"]
    assert other in packet["last_error"]["why_handed_off"] and "only a person can tell" in (op.reason or "")
