"""The secret canary on every surface an agent or a person reads: the HTTP API, the MCP server's tool
results and the console's pages (test_tenants.py's canary reads the CLI, logs, metrics, the broker
and the stored rows).

The same recognisable secrets (sensitive arguments, nested and in lists, echoed back by the provider)
and the same credential (a target header from ``${CANARY_TOKEN}``) go through every kind of
operation these surfaces show: succeeded, handed to a person, awaiting approval, a run whose second
step is rejected and whose first is compensated. Then every response body is searched for them.

Real ``agent-outbox serve`` and ``agent-outbox mcp`` processes (the official MCP SDK's client over
stdio; the console through an HTTP client holding a signed-in session), workers, relay, PostgreSQL,
Redis and the sandbox.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from outbox.ledger.models import Operation
from tests.harness import action, actions_doc, wait_for
from tests.integration.surfaces.test_api import _key, _serve
from tests.integration.surfaces.test_tenants import SECRET_CARD, SECRET_EMAIL, SECRET_TOKEN

mcp = pytest.importorskip("mcp")
import anyio  # noqa: E402
from mcp import Client  # noqa: E402

from tests.integration.surfaces.test_mcp import _call, _stdio  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
EMAIL = "notify.email.send"
EMAILS = "/v1/emails"
SECRETS = (SECRET_EMAIL, SECRET_CARD, SECRET_TOKEN)
DONE = {"succeeded", "failed_before_commit", "cancelled", "reconciliation_required", "awaiting_approval"}


def _args(subject: str) -> dict[str, Any]:
    # The provider echoes to, subject and body: ``to`` is masked by its path, the card inside the
    # body text by its value, wherever it appears.
    return {
        "to": SECRET_EMAIL,
        "subject": subject,
        "body": f"your card {SECRET_CARD} was refunded",
        "customer": {"email": SECRET_EMAIL, "name": "Ada"},
        "items": [{"sku": "s-1", "card": SECRET_CARD}],
    }


def _every_operation(pipe: Any) -> list[str]:
    with pipe.sessions() as s:
        return list(s.execute(select(Operation.id).order_by(Operation.created_at)).scalars())


def _settled(pipe: Any, client: httpx.Client, run_id: str) -> None:
    wait_for(
        lambda: (
            client.get(f"/v1/runs/{run_id}").json()["status"] not in ("running", "compensating")
            and all(pipe.op(i).status in DONE for i in _every_operation(pipe))
        ),
        40,
        what=lambda: f"every operation settled: {[pipe.op(i).status for i in _every_operation(pipe)]}",
    )


def test_a_canary_secret_reaches_no_api_mcp_or_console_response(pipe, sandbox):
    email = action(
        EMAILS,
        sensitive_args=["to", "customer.email", "items[].card"],
        sensitive_response_fields=["to"],
        approval={"required": "when", "when": "subject == 'needs approval'", "ttl_s": 600},
    )
    doc = actions_doc(sandbox.url, actions={EMAIL: email})
    doc["targets"]["sandbox"]["headers"] = {"X-Api-Token": "${CANARY_TOKEN}"}
    pipe.env.update(CANARY_TOKEN=SECRET_TOKEN, OUTBOX_RECONCILE_MAX_LOOKUPS="1")
    pipe.write_actions(doc)
    pipe.start_worker()
    pipe.start_relay()
    # Handed to a person: committed, its answer lost, every lookup failing; its packet carries the intent.
    sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern="t1:canary-handoff", count=1)
    sandbox.add_fault(mode="unavailable_503", method="GET", key_pattern="t1:canary-handoff")
    # The run's second step is refused: the first is undone by a compensation that carries the secret too.
    sandbox.add_fault(mode="reject_422", method="POST", key_pattern="*canary-run:second")
    outputs: dict[str, str] = {}

    def keep(label: str, answer: httpx.Response) -> Any:
        assert answer.status_code < 500, (label, answer.status_code, answer.text[:500])
        outputs[label] = answer.text
        return answer.json() if "json" in answer.headers.get("content-type", "") else None

    with _serve(pipe) as api:
        key = _key(api.env, "t1", "submit,read,approve,operate")
        with api.client(key) as c:
            ok = keep(
                "POST /v1/intents",
                c.post("/v1/intents", json={"action": EMAIL, "idempotency_key": "canary-ok", "args": _args("hello")}),
            )
            waiting = keep(
                "POST /v1/intents (approval)",
                c.post(
                    "/v1/intents",
                    json={"action": EMAIL, "idempotency_key": "canary-wait", "args": _args("needs approval")},
                ),
            )
            assert waiting["outcome"] == "AWAITING_APPROVAL", waiting
            handed = pipe.submit("canary-handoff", _args("again"), action=EMAIL).operation_id
            undo = {"action": EMAIL, "args": _args("sorry, undone")}
            run = keep(
                "POST /v1/runs",
                c.post(
                    "/v1/runs",
                    json={
                        "run_key": "canary-run",
                        "steps": [
                            {"name": "first", "action": EMAIL, "args": _args("step one"), "compensate": undo},
                            {"name": "second", "action": EMAIL, "args": _args("step two")},
                        ],
                    },
                ),
            )

            # The MCP server: a tool call with the same secrets; once everything has settled, every
            # operation read back through its tools.
            async def mcp_session() -> None:
                async with Client(_stdio(pipe), read_timeout_seconds=60) as client:
                    answers = {"call": await _call(client, EMAIL, _args("from a tool"), scope="canary-chat")}
                    assert not answers["call"].is_error, answers["call"].content
                    await anyio.to_thread.run_sync(lambda: _settled(pipe, c, run["run_id"]))
                    for op_id in _every_operation(pipe):
                        answers[f"get_operation {op_id}"] = await _call(
                            client, "get_operation", {"operation_id": op_id}
                        )
                        answers[f"wait_operation {op_id}"] = await _call(
                            client, "wait_operation", {"operation_id": op_id, "timeout_s": 20}
                        )
                for label, answer in answers.items():
                    parts = [p.model_dump() for p in answer.content]
                    outputs[f"mcp {label}"] = json.dumps({"content": parts, "structured": answer.structured_content})

            anyio.run(mcp_session)
            ids = _every_operation(pipe)
            assert pipe.op(ok["operation_id"]).status == "succeeded"
            assert pipe.op(handed).status == "reconciliation_required"
            final_run = keep("GET /v1/runs/{id}", c.get(f"/v1/runs/{run['run_id']}"))
            assert final_run["status"] == "compensated", final_run["reason"]

            # Every read of the API.
            for op_id in ids:
                keep(f"GET /v1/operations/{op_id}", c.get(f"/v1/operations/{op_id}"))
                keep(f"GET /v1/operations/{op_id}/wait", c.get(f"/v1/operations/{op_id}/wait", params={"timeout_s": 0}))
            listed = keep("GET /v1/operations", c.get("/v1/operations", params={"limit": 500}))
            assert len(listed["operations"]) == len(ids)
            handoffs = keep("GET /v1/handoffs", c.get("/v1/handoffs", params={"all": "true"}))
            [handoff] = handoffs["handoffs"]
            shown = keep("GET /v1/handoffs/{id}", c.get(f"/v1/handoffs/{handoff['handoff_id']}"))
            assert "***" in json.dumps(shown["packet"])  # the packet's intent is there, masked
            approvals = keep("GET /v1/approvals", c.get("/v1/approvals"))
            assert [a["operation_id"] for a in approvals["approvals"]] == [waiting["operation_id"]]
            keep("GET /v1/breakers", c.get("/v1/breakers"))
            keep("GET /v1/reports/latest", c.get("/v1/reports/latest"))

        # The console, signed in with the same key (operate, approve).
        with httpx.Client(base_url=api.url, timeout=30) as console:
            signed_in = console.post("/console/login", data={"key": key}, follow_redirects=False)
            assert signed_in.status_code == 303 and signed_in.headers["location"] == "/console", signed_in.text
            pages = ["/console", "/console/counters", "/console/operations", "/console/handoffs", "/console/approvals"]
            pages += ["/console/runs", f"/console/runs/{run['run_id']}", "/console/breakers"]
            pages += [f"/console/operations/{op_id}" for op_id in ids]
            for path in pages:
                page = console.get(path)
                assert page.status_code == 200 and "/console/login" not in str(page.url), (path, page.status_code)
                outputs[f"console {path}"] = page.text
            assert "***" in outputs[f"console /console/operations/{handed}"]  # its handoff's masked packet
        outputs["api server log"] = next(pipe.tmp.glob("api-*.log")).read_text(errors="replace")

    # The provider holds (and answers with) the secrets: they are the arguments. A miss is no accident.
    held = httpx.get(f"{sandbox.url}{EMAILS}", params={"idempotency_key": "t1:canary-ok"}, timeout=5).text
    assert SECRET_EMAIL in held and SECRET_CARD in held
    # One effect each: the API's, the handed-off one, the run's first step and its undoing, the tool call's.
    assert len(sandbox.effects()) == 5 and sandbox.duplicates() == []
    leaks = sorted({(label, secret) for label, text in outputs.items() for secret in SECRETS if secret in text})
    assert leaks == [], leaks
    # What is not sensitive is still shown: masking is not blanket.
    response = json.loads(outputs[f"GET /v1/operations/{ok['operation_id']}"])["result"]["response"]
    assert (response["to"], response["subject"], response["body"]) == ("***", "hello", "your card *** was refunded")
