"""Separation of duties by identity, not by text: the key that submitted an intent never approves it,
whatever ``subject`` its submit or ``by`` its approval says, over the HTTP API, in the console (a
session of that key) and for a run's step. In-process (FastAPI's TestClient), on both ledgers."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from outbox.access.keys import create_key
from outbox.ledger.models import Approval, Operation
from outbox.settings import Settings
from tests.harness import REFUND_ARGS, action, actions_doc
from workers.server.app import create_app

BIG = dict(REFUND_ARGS, amount="900.00")
APPROVAL = {"required": "when", "when": "amount > 500", "ttl_s": 600, "policy_version": "refunds-v3"}


@pytest.fixture
def app(ledger: Any, tmp_path: Any) -> Any:
    refund = action("/v1/refunds", decimal_args=["amount"], approval=APPROVAL | {"separate_approver": True})
    doc = actions_doc("http://127.0.0.1:9", actions={"payments.refund.create": refund})
    actions_file = tmp_path / "actions.yaml"
    actions_file.write_text(yaml.safe_dump(doc))
    with ledger.sessions.begin() as s:
        both, _ = create_key(s, tenant="t1", scopes=["submit", "read", "approve"])
        other, _ = create_key(s, tenant="t1", scopes=["approve", "read"])
    settings = Settings(database_url=ledger.url, data_dir=tmp_path, actions_file=actions_file)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        yield client, both, other


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _status(ledger: Any, operation_id: str) -> str:
    with ledger.sessions() as s:
        op = s.get(Operation, operation_id)
        assert op is not None
        return op.status


def _approvals(ledger: Any, operation_id: str) -> list[Any]:
    with ledger.sessions() as s:
        return list(s.query(Approval).filter(Approval.operation_id == operation_id))


def test_a_key_cannot_approve_its_own_intent_whatever_subject_and_by_say(app, ledger):
    client, both, other = app
    body = {"action": "payments.refund.create", "idempotency_key": "sod-1", "args": BIG, "subject": "x"}
    op = client.post("/v1/intents", json=body, headers=_h(both)).json()
    assert op["status"] == "awaiting_approval" and op["submitted_by"].startswith("key:"), op
    refused = client.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "y"}, headers=_h(both))
    assert refused.status_code == 403, refused.text
    assert refused.json()["type"].endswith("/separation-of-duties") and "cannot approve" in refused.json()["detail"]
    assert _status(ledger, op["operation_id"]) == "awaiting_approval" and _approvals(ledger, op["operation_id"]) == []
    # Another key may, under any name but the subject that asked.
    own = client.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "x"}, headers=_h(other))
    assert own.status_code == 422 and own.json()["field"] == "by"
    ok = client.post(f"/v1/approvals/{op['operation_id']}/approve", json={"by": "alice"}, headers=_h(other))
    assert ok.status_code == 200, ok.text
    assert _status(ledger, op["operation_id"]) == "not_dispatched"


def test_a_console_session_of_the_submitting_key_cannot_approve(app, ledger):
    client, both, _ = app
    body = {"action": "payments.refund.create", "idempotency_key": "sod-2", "args": BIG, "subject": "x"}
    op = client.post("/v1/intents", json=body, headers=_h(both)).json()
    signed_in = client.post("/console/login", data={"key": both}, follow_redirects=False)
    assert signed_in.status_code == 303
    page = client.get("/console/approvals")
    assert op["operation_id"] in page.text  # shown: the key may read and approve others' intents
    csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
    answered = client.post(
        f"/console/approvals/{op['operation_id']}/approve", data={"csrf": csrf, "by": "y", "note": "looks fine"}
    )
    assert answered.status_code == 200 and "cannot approve" in answered.text
    assert _status(ledger, op["operation_id"]) == "awaiting_approval" and _approvals(ledger, op["operation_id"]) == []


def test_a_run_step_carries_its_submitter_and_that_key_cannot_approve_it(app, ledger):
    client, both, other = app
    run = {
        "run_key": "sod-run",
        "subject": "x",
        "steps": [{"name": "refund", "action": "payments.refund.create", "args": BIG}],
    }
    made = client.post("/v1/runs", json=run, headers=_h(both))
    assert made.status_code == 201, made.text
    identity = op_identity(both, ledger)
    with ledger.sessions() as s:
        step = s.query(Operation).filter(Operation.idempotency_key == "sod-run:refund").one()
    assert step.status == "awaiting_approval" and step.submitted_by == identity
    refused = client.post(f"/v1/approvals/{step.id}/approve", json={"by": "y"}, headers=_h(both))
    assert refused.status_code == 403, refused.text
    assert client.post(f"/v1/approvals/{step.id}/approve", json={"by": "bob"}, headers=_h(other)).status_code == 200


def op_identity(key: str, ledger: Any) -> str:
    from outbox.access.keys import verify

    with ledger.sessions() as s:
        caller = verify(s, key)
        assert caller is not None
        return caller.identity
