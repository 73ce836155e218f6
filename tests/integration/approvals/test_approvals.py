"""Approvals (issue 17): bound to the exact arguments, expiring, versioned, re-checked at the send.
Real workers, relay, PostgreSQL and the sandbox; effects are counted by the sandbox."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import CLOCK_LEASE, REFUND_ARGS, action, actions_doc, pk, wait_for
from tests.integration.surfaces.test_tenants import _cli
from workers.provider.actions import load_actions

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
BIG = dict(REFUND_ARGS, amount="900.00")


def _rules(pipe: Any, *, ttl_s: float = 60, policy: str = "refunds-v3") -> Any:
    refund = action(
        "/v1/refunds",
        decimal_args=["amount"],
        approval={
            "required": "when",
            "when": "amount > 500",
            "ttl_s": ttl_s,
            "policy_version": policy,
            "separate_approver": True,
        },
    )
    pipe.write_actions(actions_doc(pipe.sandbox_url, actions={"payments.refund.create": refund}))
    return load_actions(pipe.env["OUTBOX_ACTIONS_FILE"])


def _submit(pipe: Any, key: str, rules: Any, args: dict[str, Any] = BIG) -> str:
    return pipe.submit(key, dict(args), rules=rules, subject="agent:bot").operation_id


def test_approve_then_dispatch_makes_one_effect_and_says_who(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    rules = _rules(pipe)
    pipe.start_worker()
    pipe.start_relay()
    small = _submit(pipe, "ap-small", rules, REFUND_ARGS)  # 12.50: no approval needed
    big, other = _submit(pipe, "ap-big", rules), _submit(pipe, "ap-other", rules)
    pipe.wait_status(small, "succeeded")
    assert pipe.op(big).status == pipe.op(other).status == "awaiting_approval"
    assert sandbox.effects(key=pk("ap-big")) == []  # nothing sent while it waits

    listed = json.loads(_cli(pipe, "approvals", "list", "--json").stdout)
    assert {r["operation_id"] for r in listed} == {big, other}
    refused = _cli(pipe, "approvals", "approve", big, "--by", "agent:bot")
    assert refused.returncode == 2 and "separate_approver" in refused.stderr  # who asked cannot approve
    done = _cli(pipe, "approvals", "approve", big, "--by", "alice", "--note", "checked the order")
    assert done.returncode == 0, done.stderr
    pipe.wait_status(big, "succeeded")
    assert len(sandbox.effects(key=pk("ap-big"))) == 1
    # The approval covers its operation only: the other one still waits, nothing sent for it.
    assert pipe.op(other).status == "awaiting_approval" and sandbox.effects(key=pk("ap-other")) == []
    shown = json.loads(_cli(pipe, "ops", "show", big, "--json").stdout)
    assert shown["approval"]["approver"] == "alice" and shown["approval"]["policy_version"] == "refunds-v3"
    assert shown["approval"]["args_digest"] == shown["args_digest"] and shown["approval"]["expires_at"]
    assert any(e["event"] == "approve" and e["actor"] == "alice" for e in shown["history"])


def test_an_intent_submitted_without_the_rules_is_still_never_sent_unapproved(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    _rules(pipe)
    pipe.start_worker()
    pipe.start_relay()
    bare = pipe.submit("ap-bare", dict(BIG), subject="agent:bot").operation_id  # no rules: not_dispatched
    wait_for(lambda: pipe.op(bare).status == "awaiting_approval", 20, what="parked for approval at the send")
    assert "none is on record" in pipe.op(bare).reason and pipe.op(bare).attempt_count == 0
    assert sandbox.requests(method="POST") == []


def test_deny_cancels_with_the_reason_and_sends_nothing(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    rules = _rules(pipe)
    pipe.start_worker()
    pipe.start_relay()
    op = _submit(pipe, "ap-deny", rules)
    done = _cli(pipe, "approvals", "deny", op, "--by", "bob", "--note", "duplicate request")
    assert done.returncode == 0, done.stderr
    row = pipe.op(op)
    assert row.status == "cancelled" and "denied by bob: duplicate request" in row.reason
    assert sandbox.requests(method="POST") == []


def test_an_approval_that_expired_before_the_send_sends_nothing(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    pipe.env.update(CLOCK_LEASE)
    rules = _rules(pipe, ttl_s=60)
    op = _submit(pipe, "ap-expired", rules)
    assert _cli(pipe, "approvals", "approve", op, "--by", "alice").returncode == 0
    pipe.advance_ledger_clock(61)  # the approval (given 61 s ago) has expired before any worker ran
    pipe.start_worker()
    pipe.start_relay()
    wait_for(lambda: pipe.op(op).status == "awaiting_approval", 20, what="back to awaiting approval")
    row = pipe.op(op)
    assert "expired" in row.reason and row.attempt_count == 0 and row.waiting_for == "approval"
    assert sandbox.requests(method="POST") == []


def test_a_policy_changed_while_waiting_sends_nothing_until_approved_again(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    rules = _rules(pipe, policy="refunds-v3")
    op = _submit(pipe, "ap-policy", rules)
    assert _cli(pipe, "approvals", "approve", op, "--by", "alice").returncode == 0
    _rules(pipe, policy="refunds-v4")  # the policy changes before any worker sends it
    pipe.start_worker()
    pipe.start_relay()
    wait_for(lambda: pipe.op(op).status == "awaiting_approval", 20, what="back to awaiting approval")
    assert "policy refunds-v3" in pipe.op(op).reason and "refunds-v4" in pipe.op(op).reason
    assert sandbox.requests(method="POST") == []
    assert _cli(pipe, "approvals", "approve", op, "--by", "carol").returncode == 0
    pipe.wait_status(op, "succeeded")
    assert len(sandbox.effects(key=pk("ap-policy"))) == 1


def test_a_worker_that_claimed_just_before_the_expiry_rechecks_under_its_token(pipe, sandbox):
    pipe.sandbox_url = sandbox.url
    rules = _rules(pipe, ttl_s=3)
    # The worker claims while the approval is valid, then stalls 5 s before the send: inside its
    # lease (60 s here), so it is the worker itself that must see the expiry, under its token.
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_SOFT_TIME_LIMIT_S": "10", "OUTBOX_TIME_LIMIT_S": "12"})
    pipe.start_worker(extra_env={"OUTBOX_FAILPOINTS": "dispatch.after_claim=sleep:5@ap-late"})
    pipe.start_relay()
    op = _submit(pipe, "ap-late", rules)
    assert _cli(pipe, "approvals", "approve", op, "--by", "alice").returncode == 0
    wait_for(lambda: pipe.op(op).status == "dispatching", 10, what="claimed while the approval held")
    wait_for(
        lambda: pipe.op(op).status == "awaiting_approval",
        20,
        what=lambda: f"back to awaiting approval at the send (now {pipe.op(op).status}: {pipe.op(op).reason})",
    )
    assert "expired" in pipe.op(op).reason and pipe.op(op).attempt_count == 0
    assert sandbox.requests(method="POST") == []
    [attempt] = pipe.attempts(op, kind="dispatch")
    assert attempt.attempt_class == "not_sent" and "expired" in (attempt.error or "")


def test_approvals_over_http_need_the_approve_scope_and_stay_in_the_tenant(pipe, sandbox):
    from tests.integration.surfaces.test_api import _key, _serve

    pipe.sandbox_url = sandbox.url
    _rules(pipe)
    pipe.start_worker()
    pipe.start_relay()
    with _serve(pipe) as api:
        submitter = _key(api.env, "acme", "submit,read")
        both = _key(api.env, "acme", "submit,read,approve")
        approver = _key(api.env, "acme", "approve,read")
        stranger = _key(api.env, "other", "approve,read")
        with api.client(submitter) as c:
            body = {"action": "payments.refund.create", "idempotency_key": "ap-http", "args": BIG}
            op = c.post("/v1/intents", json=body).json()
            assert op["outcome"] == "AWAITING_APPROVAL" and "approval" in op["model_message"]
            assert c.get("/v1/approvals").status_code == 403
            assert c.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "x"}).status_code == 403
        with api.client(both) as c:  # a key holding both scopes cannot approve its own intent
            body = {"action": "payments.refund.create", "idempotency_key": "ap-self", "args": BIG}
            mine = c.post("/v1/intents", json=body).json()["operation_id"]
            selfish = c.post(f"/v1/approvals/{mine}/approve", json={"by": "someone-else"})
            assert selfish.status_code == 403 and "submitted the intent" in selfish.json()["detail"]
        with api.client(stranger) as c:
            assert c.get("/v1/approvals").json()["approvals"] == []
            assert c.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "eve"}).status_code == 404
        with api.client(approver) as c:
            waiting = {w["operation_id"] for w in c.get("/v1/approvals").json()["approvals"]}
            assert op["operation_id"] in waiting
            own = c.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": op["subject"]})
            assert own.status_code == 422 and own.json()["field"] == "by"
            ok = c.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "alice", "note": "fine"})
            assert ok.status_code == 200 and ok.json()["policy_version"] == "refunds-v3", ok.text
            done = c.get(f"/v1/operations/{op['operation_id']}/wait", params={"timeout_s": 20}).json()
            assert done["outcome"] == "SUCCEEDED" and done["approval"]["approver"].startswith("alice (api:key-")
    assert len(sandbox.effects(key=pk("ap-http", "acme"))) == 1
