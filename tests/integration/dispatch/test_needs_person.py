"""The "needs a person" class (issue 50, point 5), through the real pipeline: the relay, Celery
worker processes, PostgreSQL, Redis and the sandbox over HTTP; every request counted at the sandbox.

- a 401/403 (a target's ``authority_statuses``) goes to a person, never a second request, the packet
  says why and what to do; resolved "not executed" once the credentials are fixed: sent again under
  the same key, one effect; it does not count against the breaker;
- a target whose 403 means something else (``authority_statuses: [401]``) keeps failing it;
- ``on_final_failure: handoff``: a business rejection, or a budget spent on 503s, goes to a person;
- ``evidence: {required: true}``: nothing is sent while the separate evidence store is down (a real
  PostgreSQL database that refuses connections), then exactly one effect once it is back.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.models import Evidence, Handoff
from outbox.ledger.typed_outcome import with_outcome
from outbox.reads.queries import operation_json
from tests.harness import action, actions_doc, pk, wait_for
from tests.integration.reconcile import test_reconcile
from tests.integration.surfaces.test_tenants import _cli

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
# A separate PostgreSQL database for the evidence store, which a test takes down for real (the
# fixture of test_reconcile.py, under this name here).
evidence_store = test_reconcile.evidence_db


def _posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sandbox.requests(method="POST", key=pk(key))


def _handoff(pipe: Any, operation_id: str) -> Handoff:
    with pipe.sessions() as s:
        found = s.execute(select(Handoff).where(Handoff.operation_id == operation_id)).scalars().all()
    assert len(found) == 1, found
    return found[0]


def _said(pipe: Any, operation_id: str) -> dict[str, Any]:
    return with_outcome(operation_json(pipe.op(operation_id)))


def test_a_403_goes_to_a_person_never_a_second_request_and_the_packet_says_why(pipe, sandbox):
    # fail_max 1: were the refusal counted against the breaker, the next operation would be parked.
    pipe.write_actions(actions_doc(sandbox.url, breaker={"fail_max": 1, "reset_timeout_s": 600}))
    sandbox.add_fault(mode="refuse_credentials", status=403, key_pattern=pk("np-403"))
    pipe.start_worker()
    pipe.start_relay()
    refused = pipe.submit("np-403")
    op = pipe.wait_status(refused.operation_id, "reconciliation_required", "failed_before_commit")
    assert op.status == "reconciliation_required" and op.waiting_for == "credentials", (op.status, op.reason)
    assert [p["status"] for p in _posts(sandbox, "np-403")] == [403]
    assert op.attempt_count == 1 and op.error_class == "rejected"

    packet = _handoff(pipe, refused.operation_id).packet
    assert "refused our credentials for target sandbox" in packet["last_error"]["why_handed_off"]
    step = packet["next_step"]
    assert "refused our credentials (HTTP 403)" in step and "nothing was executed" in step
    assert "targets.sandbox.headers" in step and "--as not-executed" in step and pk("np-403") in step
    said = _said(pipe, refused.operation_id)
    assert said["outcome"] == "NEEDS_HUMAN" and "refused our credentials" in said["model_message"]
    assert "do not tell the user it failed" in said["model_message"]

    # Not a provider failure: the breaker (fail_max 1) stayed closed, the next one leaves at once.
    other = pipe.submit("np-next")
    assert pipe.wait_status(other.operation_id, "succeeded").waiting_for is None
    # Nothing sends it again: a minute later (its ledger time: past every backoff, inside the deadline
    # its resolution below still needs), after more traffic, still one request.
    pipe.advance_ledger_clock(60, operation_ids=[refused.operation_id])
    later = pipe.submit("np-later")
    pipe.wait_status(later.operation_id, "succeeded")
    assert [p["status"] for p in _posts(sandbox, "np-403")] == [403]
    assert pipe.op(refused.operation_id).status == "reconciliation_required"

    # The credentials are fixed; a person says "not executed": sent again under the same key, once.
    sandbox.clear_faults()
    out = _cli(
        pipe,
        "handoffs",
        "resolve",
        str(_handoff(pipe, refused.operation_id).id),
        "--as",
        "not-executed",
        "--by",
        "alice",
        "--note",
        "API key rotated",
    )
    assert out.returncode == 0, out.stderr
    done = pipe.wait_status(refused.operation_id, "succeeded")
    posts = _posts(sandbox, "np-403")
    assert [p["status"] for p in posts] == [403, 200] and posts[1]["fencing_token"] > posts[0]["fencing_token"]
    effects = sandbox.effects(key=pk("np-403"))
    assert len(effects) == 1 and done.result_reference == effects[0]["object_id"]


def test_a_target_whose_403_is_not_an_authority_refusal_keeps_failing_it(pipe, sandbox):
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["authority_statuses"] = [401]  # its 403 is a temporary block (SendGrid)
    pipe.write_actions(doc)
    sandbox.add_fault(mode="refuse_credentials", status=403, key_pattern=pk("np-blocked"))
    sandbox.add_fault(mode="refuse_credentials", status=401, key_pattern=pk("np-revoked"))
    pipe.start_worker()
    pipe.start_relay()
    blocked, revoked = pipe.submit("np-blocked"), pipe.submit("np-revoked")
    op = pipe.wait_status(blocked.operation_id, "failed_before_commit", "reconciliation_required")
    assert op.status == "failed_before_commit" and op.waiting_for is None, op.reason
    assert [p["status"] for p in _posts(sandbox, "np-blocked")] == [403]
    op = pipe.wait_status(revoked.operation_id, "reconciliation_required", "failed_before_commit")
    assert op.status == "reconciliation_required" and op.waiting_for == "credentials"
    assert [p["status"] for p in _posts(sandbox, "np-revoked")] == [401]
    assert "(HTTP 401)" in _handoff(pipe, revoked.operation_id).packet["next_step"]


def test_on_final_failure_handoff_sends_a_rejection_to_a_person_not_failed_before_commit(pipe, sandbox):
    budget = {"max_attempts": 2, "deadline_s": 120, "base_delay_s": 0.05, "max_delay_s": 0.2}
    doc = actions_doc(
        sandbox.url,
        actions={
            "payments.refund.create": action(
                REFUNDS, decimal_args=["amount"], on_final_failure="handoff", budget=budget
            ),
            "support.ticket.create": action("/v1/tickets"),  # the default: fail
        },
    )
    pipe.write_actions(doc)
    sandbox.add_fault(mode="reject_422", key_pattern=pk("np-422"))
    sandbox.add_fault(mode="unavailable_503", key_pattern=pk("np-503"))
    sandbox.add_fault(mode="reject_422", key_pattern=pk("np-422-ticket"))
    pipe.start_worker()
    pipe.start_relay()
    rejected = pipe.submit("np-422")
    spent = pipe.submit("np-503")
    ticket = pipe.submit("np-422-ticket", {"subject": "s", "customer_id": "c-1"}, action="support.ticket.create")

    op = pipe.wait_status(rejected.operation_id, "reconciliation_required", "failed_before_commit")
    assert op.status == "reconciliation_required" and op.waiting_for == "decision", (op.status, op.reason)
    assert [p["status"] for p in _posts(sandbox, "np-422")] == [422]
    packet = _handoff(pipe, rejected.operation_id).packet
    assert "http_422" in packet["last_error"]["why_handed_off"]
    assert "on_final_failure: handoff" in packet["last_error"]["why_handed_off"]
    assert "would have ended failed_before_commit" in packet["next_step"]
    said = _said(pipe, rejected.operation_id)
    assert said["outcome"] == "NEEDS_HUMAN" and said["model_message"].startswith("Not executed:")

    op = pipe.wait_status(spent.operation_id, "reconciliation_required", "failed_before_commit")
    assert op.status == "reconciliation_required" and op.waiting_for == "decision", (op.status, op.reason)
    assert "budget spent" in op.reason or "attempts used up" in op.reason, op.reason
    assert [p["status"] for p in _posts(sandbox, "np-503")] == [503, 503]

    # An action that does not ask for it fails as before.
    assert pipe.wait_status(ticket.operation_id, "failed_before_commit", "reconciliation_required").status == (
        "failed_before_commit"
    )
    assert sandbox.effects() == []


def test_evidence_required_sends_nothing_while_the_store_is_down_then_exactly_one_effect(
    pipe, sandbox, evidence_store, monkeypatch
):
    import workers.relay.loop

    monkeypatch.setattr(workers.relay.loop, "BACKFILL_EVERY_S", 0.2)  # the relay runs in this process
    doc = actions_doc(
        sandbox.url,
        actions={
            "payments.refund.create": action(REFUNDS, decimal_args=["amount"], evidence={"required": True}),
            "support.ticket.create": action("/v1/tickets"),  # not required: sent, degraded, backfilled
        },
    )
    pipe.write_actions(doc)
    pipe.env["OUTBOX_EVIDENCE_URL"] = evidence_store.url
    evidence_store.down()  # a real database that refuses connections, before the worker starts
    sink = EvidenceSink.from_url(evidence_store.url)
    try:
        pipe.start_worker()
        pipe.start_relay(evidence_sink=sink)
        r = pipe.submit("ev-required")
        t = pipe.submit("ev-other", {"subject": "s", "customer_id": "c-1"}, action="support.ticket.create")
        # The other action is sent: its effect happened, its evidence is repaired later.
        assert pipe.wait_status(t.operation_id, "committed_evidence_degraded").result_reference
        op = wait_for(
            lambda: (o := pipe.op(r.operation_id)).waiting_for == "evidence" and o.status == "not_dispatched" and o,
            20,
            what=lambda: f"waiting for the evidence store (now {pipe.op(r.operation_id).status})",
        )
        assert "evidence store is down" in op.reason
        said = _said(pipe, r.operation_id)
        assert said["outcome"] == "PENDING" and "evidence store is down" in said["model_message"]
        # Looked at again and again: still nothing sent, no attempt spent.
        for _ in range(3):
            seen = len(pipe.attempts(r.operation_id))
            pipe.advance_to_due(r.operation_id)
            wait_for(lambda: len(pipe.attempts(r.operation_id)) > seen, 20, what="another look at the store")
        assert _posts(sandbox, "ev-required") == []
        assert pipe.wait_status(r.operation_id, "not_dispatched").attempt_count == 0
        assert {a.attempt_class for a in pipe.attempts(r.operation_id)} == {"not_sent"}

        evidence_store.up()
        op = wait_for(
            lambda: (
                pipe.advance_to_due(r.operation_id) >= 0 and (o := pipe.op(r.operation_id)).status == "succeeded" and o
            ),
            30,
            interval_s=0.5,
            what=lambda: f"sent once the store is back (now {pipe.op(r.operation_id).status})",
        )
        assert [p["status"] for p in _posts(sandbox, "ev-required")] == [200]
        effects = sandbox.effects(key=pk("ev-required"))
        assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
        pipe.wait_status(t.operation_id, "succeeded", timeout_s=20)  # backfilled
        with sink.engine.connect() as conn:  # type: ignore[union-attr]
            recorded = dict(conn.execute(select(Evidence.operation_id, Evidence.provider_reference)).all())
        assert recorded[r.operation_id] == op.result_reference
        assert len(sandbox.effects(key=pk("ev-other"))) == 1
    finally:
        sink.close()
