"""A lookup that saw only others' objects, at a provider that does not honour idempotency keys (review of
issue 50, finding 6), through the real pipeline: relay, Celery worker, PostgreSQL, Redis, the sandbox.

The refunds action sends no key (no ``provider_idempotency``) and looks up by order with ``match:``.
Its match is slightly wrong: it compares the currency exactly while the provider writes it lower-case,
so our own refund looks "not ours". The answer to our request is lost after the commit. Every lookup
then sees only "others' objects" (an earlier refund of the order, and ours): that is no proof that ours
was never made, so it is looked up again and then a person decides; a re-send would be a second refund.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.harness import CLOCK_LEASE, REFUND_ARGS, action, actions_doc, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"


def _without_keys() -> dict[str, Any]:
    refund = action(
        REFUNDS,
        lookup={
            "request": {"method": "GET", "path": REFUNDS, "query": {"order_id": "{order_id}"}},
            "items": "data",
            "match": {"order_id": "{order_id}", "amount": "{amount}", "currency": "{currency}"},  # "EUR" != "eur"
            "authoritative_not_found": True,
            "settle_s": 0.2,
            "succeeded": ["succeeded"],
            "pending": ["pending"],
            "failed": ["failed"],
        },
        args=["order_id", "amount", "currency", "reason"],
        decimal_args=["amount"],
    )
    del refund["provider_idempotency"]
    del refund["fencing_header"]
    return {"payments.refund.create": refund}


def test_only_others_objects_without_provider_keys_goes_to_a_person_never_a_resend(pipe, sandbox):
    body = {"order_id": REFUND_ARGS["order_id"], "amount": "5.00", "currency": "EUR", "reason": "earlier"}
    assert httpx.post(sandbox.url + REFUNDS, json=body, timeout=5).status_code == 200  # someone else's
    pipe.write_actions(actions_doc(sandbox.url, actions=_without_keys()))
    sandbox.add_fault(mode="commit_then_drop", method="POST", path=REFUNDS, count=1)
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "3"})
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("oo-nokeys")

    def handed_off() -> bool:
        pipe.advance_to_due(r.operation_id)  # each re-check is moved to, not waited for
        return pipe.op(r.operation_id).status == "reconciliation_required"

    wait_for(handed_off, 40, 0.2, what="a person, once the lookups are spent")
    op = pipe.op(r.operation_id)
    assert "found only others' objects" in (op.reason or "") and "does not honour idempotency keys" in (op.reason or "")
    lookups = [a for a in pipe.attempts(r.operation_id, "lookup") if a.ended_at is not None]
    assert len(lookups) == 3 and all("none of them ours" in (a.error or "") for a in lookups)
    assert len(sandbox.requests(method="POST", path=REFUNDS)) == 2  # the earlier refund and ours: never re-sent
    assert len(sandbox.effects()) == 2
