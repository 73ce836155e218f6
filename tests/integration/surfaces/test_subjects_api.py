"""An emergency stop of a subject over HTTP and in the console (FastAPI's TestClient, on both ledgers):
``POST /v1/subjects/{subject}:stop`` / ``:resume`` and ``GET /v1/subjects`` (scope ``operate``), per
tenant; a stopped subject's new intent is answered 409 ``subject-stopped`` (problem+json, and a named
error in the Python client); the console shows who stopped it and when, with stop and resume."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from outbox.access.keys import create_key
from outbox.ledger.authority import board_for
from outbox.settings import Settings
from producer.remote import SubjectStopped
from producer.remote.problems import problem_of
from tests.harness import REFUND_ARGS, actions_doc
from workers.server.app import create_app


@pytest.fixture
def api(ledger: Any, tmp_path: Any) -> Any:
    actions_file = tmp_path / "actions.yaml"
    actions_file.write_text(yaml.safe_dump(actions_doc("http://127.0.0.1:9")))
    with ledger.sessions.begin() as s:
        keys = {
            "op1": create_key(s, tenant="t1", scopes=["operate", "read"])[0],
            "sub1": create_key(s, tenant="t1", scopes=["submit", "read"])[0],
            "op2": create_key(s, tenant="t2", scopes=["operate", "submit"])[0],
        }
    board_for(ledger.engine).forget()  # another test's stop must not linger in this process
    settings = Settings(database_url=ledger.url, data_dir=tmp_path, actions_file=actions_file)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        yield client, keys


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _intent(key: str, subject: str = "agent:bot") -> dict[str, Any]:
    return {"action": "payments.refund.create", "idempotency_key": key, "args": REFUND_ARGS, "subject": subject}


def test_stop_refuses_new_intents_of_the_subject_in_its_tenant_only_and_resume_lifts_it(api):
    client, keys = api
    held = client.post("/v1/intents", json=_intent("ss-0"), headers=_h(keys["sub1"])).json()
    stop = client.post("/v1/subjects/agent:bot:stop", json={"by": "alice", "reason": "loops"}, headers=_h(keys["op1"]))
    assert stop.status_code == 200, stop.text
    done = stop.json()
    assert (done["tenant"], done["subject"], done["reason"], done["held"]) == ("t1", "agent:bot", "loops", 1)
    assert done["stopped_by"].startswith("alice (api:key-") and done["stopped_at"]
    shown = client.get(f"/v1/operations/{held['operation_id']}", headers=_h(keys["sub1"])).json()
    assert shown["waiting_for"] == "stopped" and shown["model_message"].startswith("On hold, nothing sent")

    refused = client.post("/v1/intents", json=_intent("ss-1"), headers=_h(keys["sub1"]))
    assert refused.status_code == 409 and refused.headers["content-type"] == "application/problem+json"
    body = refused.json()
    assert body["type"].endswith("/subject-stopped") and body["outcome"] == "REFUSED"
    assert body["stopped"]["stopped_by"] == done["stopped_by"] and "on hold" in body["detail"]
    # The Python client's named error (producer.remote); a replay of an intent accepted before is answered.
    named = problem_of(httpx.Response(409, content=refused.content))
    assert isinstance(named, SubjectStopped) and named.stopped["subject"] == "agent:bot"
    assert client.post("/v1/intents", json=_intent("ss-0"), headers=_h(keys["sub1"])).status_code == 200
    ok = client.post("/v1/intents", json=_intent("ss-3", "agent:other"), headers=_h(keys["sub1"]))
    assert ok.status_code == 201, ok.text  # another subject flows

    # A wall: the other tenant neither sees nor lifts it, and its own agent:bot is not stopped.
    assert client.get("/v1/subjects", headers=_h(keys["op2"])).json() == {"stops": []}
    assert client.post("/v1/intents", json=_intent("ss-4"), headers=_h(keys["op2"])).status_code == 201
    other = client.post("/v1/subjects/agent:bot:resume", json={"by": "mallory"}, headers=_h(keys["op2"]))
    assert other.status_code == 422 and "not stopped in tenant t2" in other.json()["detail"]
    # The scope: a key without operate may not stop anything.
    denied = client.post("/v1/subjects/agent:bot:stop", json={"by": "x"}, headers=_h(keys["sub1"]))
    assert denied.status_code == 403
    listed = client.get("/v1/subjects", headers=_h(keys["op1"])).json()["stops"]
    assert [(s["subject"], s["reason"]) for s in listed] == [("agent:bot", "loops")]

    resumed = client.post("/v1/subjects/agent:bot:resume", json={"by": "bob"}, headers=_h(keys["op1"]))
    assert resumed.status_code == 200 and resumed.json()["woken"] == 1 and resumed.json()["stopped"] is False
    assert client.post("/v1/intents", json=_intent("ss-5"), headers=_h(keys["sub1"])).status_code == 201
    assert client.get("/v1/subjects", headers=_h(keys["op1"])).json() == {"stops": []}


def test_a_subject_with_a_slash_and_a_colon_is_one_path_segment_of_its_own(api):
    client, keys = api
    stop = client.post("/v1/subjects/team/bot:7:stop", json={"by": "alice"}, headers=_h(keys["op1"]))
    assert stop.status_code == 200 and stop.json()["subject"] == "team/bot:7"
    blank = client.post("/v1/subjects/agent:bot:stop", json={"by": " "}, headers=_h(keys["op1"]))
    assert blank.status_code == 422
    # The schema's longest `by` (200) is taken: the key that vouches for it is recorded beside it.
    longest = client.post("/v1/subjects/agent:long:stop", json={"by": "a" * 200}, headers=_h(keys["op1"]))
    assert longest.status_code == 200 and longest.json()["stopped_by"].startswith("a" * 200 + " (api:key-"), (
        longest.text
    )
    longer = client.post("/v1/subjects/agent:long:stop", json={"by": "a" * 201}, headers=_h(keys["op1"]))
    assert longer.status_code == 422


def test_the_console_shows_who_stopped_a_subject_and_when_and_stops_and_resumes_it(api):
    client, keys = api
    assert client.post("/console/login", data={"key": keys["op1"]}, follow_redirects=False).status_code == 303
    page = client.get("/console/subjects")
    assert page.status_code == 200 and "no subject is stopped" in page.text and 'href="/console/subjects"' in page.text
    csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
    done = client.post(
        "/console/subjects/stop", data={"csrf": csrf, "subject": "agent:bot", "reason": "loops", "by": "carol"}
    )
    assert done.status_code == 200 and "agent:bot stopped" in done.text
    assert "carol (api:key-" in done.text and "loops" in done.text  # who, and why, with when beside
    assert client.post("/v1/intents", json=_intent("sc-1"), headers=_h(keys["sub1"])).status_code == 409
    forged = client.post("/console/subjects/resume", data={"csrf": "nope", "subject": "agent:bot", "by": "x"})
    assert forged.status_code == 403
    done = client.post("/console/subjects/resume", data={"csrf": csrf, "subject": "agent:bot", "by": "dave"})
    assert done.status_code == 200 and "agent:bot resumed" in done.text and "no subject is stopped" in done.text
    assert client.post("/v1/intents", json=_intent("sc-2"), headers=_h(keys["sub1"])).status_code == 201


def test_an_agents_tool_call_of_a_stopped_subject_gets_a_typed_refusal_and_a_held_one_says_on_hold(ledger, tmp_path):
    """The agent surfaces (MCP, the Agents SDK and LangGraph helpers) share ToolCaller's answers."""
    from outbox.actions.rules import load_action_rules
    from outbox.ledger import stops
    from producer.agents.calls import ToolCaller
    from producer.client import Outbox

    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc("http://127.0.0.1:9")))
    rules = load_action_rules(path)
    board_for(ledger.engine).forget()
    caller = ToolCaller(Outbox(ledger.engine, rules=rules), rules, tenant="t1", subject="agent:tool")
    args = {"order_id": "o-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}
    first = caller.call("payments.refund.create", args, scope="conv-1")
    with ledger.sessions.begin() as s:
        stops.stop(s, tenant="t1", subject="agent:tool", by="alice", reason="loops")
    held = caller.call("payments.refund.create", args, scope="conv-1")  # the same call: held, said so
    assert held.operation_id == first.operation_id and held.model_message.startswith("On hold, nothing sent")
    refused = caller.call("payments.refund.create", dict(args, order_id="o-2"), scope="conv-1")
    assert (refused.outcome, refused.status, refused.operation_id) == ("REFUSED", "refused", None)
    assert "stopped by alice" in refused.model_message and "on hold" in refused.model_message
