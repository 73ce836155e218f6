"""The HTTP API's OpenAPI document holds for generated clients: every ``$ref`` resolves inside it,
and schemathesis (its CLI, every check, all four phases: examples, coverage, fuzzing, stateful)
finds nothing when it sends what the document allows, and what it forbids, to a real
``agent-outbox serve`` over PostgreSQL with an operator's key."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.ledger.states import Status
from tests import spawn
from tests.harness import action, actions_doc
from tests.integration.surfaces.test_api import Api, _intent, _key, _serve

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

# Per operation and phase; the run takes about 30 s on a busy 2-core machine.
MAX_EXAMPLES = 50
ACTIONS = {
    "payments.refund.create": action("/v1/refunds", decimal_args=["amount"]),
    # Waits for a person: the stateful phase approves and denies what it submits.
    "support.ticket.create": action("/v1/tickets", approval={"required": "always"}),
}
# Accepted answers to a request the document allows, where the server checks a rule the document
# cannot state (positive_data_acceptance's own list, plus 422); each use below names its rules.
WITH_RULES = '["2xx", "401", "403", "404", "409", "422", "429"]'

SCHEMATHESIS_CONFIG = """\
# Written by tests/integration/surfaces/test_api_fuzz.py. The key comes from the environment.
headers = {{ Authorization = "Bearer ${{FUZZ_KEY}}" }}
workers = 1
# A big batch on a loaded machine (the suite runs 4 processes on 2 cores) may take more than the
# default 10 s: a timeout is a network error, not a finding.
request-timeout = 60

[generation]
max-examples = {max_examples}
deterministic = true
database = "none"

# This server's actions: most generated intents and steps name one, so they reach the ledger.
[dictionaries.actions]
values = {actions}

# The action must be one of the actions file's; the idempotency key comes in the body or in the
# Idempotency-Key header, one of the two.
[[operations]]
include-method = "POST"
include-path = "/v1/intents"
parameters = {{ "body.action" = {{ dictionary = "actions", probability = 0.9 }} }}
checks.positive_data_acceptance.expected-statuses = {with_rules}

# The batch answers its items one by one (docs/how-to/http-api.md): an item the document refuses gets its 422 in
# the results while the good ones are stored, so such a batch is a 200.
[[operations]]
include-method = "POST"
include-path = "/v1/intents:batch"
parameters = {{ "body.intents[*].action" = {{ dictionary = "actions", probability = 0.9 }} }}
checks.negative_data_rejection.expected-statuses = ["200", "400", "401", "403", "404", "413", "422", "429"]
# 500 items answered one by one (a savepoint each) in one transaction: 12.5 s for 473 in a CI run
# where the suite's 4 processes shared 2 cores, over the check's default 10 s. The batch's speed is
# bench.api_bench's to measure; here a slow answer is not a finding, a wrong one is.
checks.max_response_time = 60

# Step names are unique in a run; run_key:name:compensate fits 255 characters; at most one commit
# step, the last; an irreversible action has no compensation.
[[operations]]
include-method = "POST"
include-path = "/v1/runs"
parameters = {{ "body.steps[*].action" = {{ dictionary = "actions", probability = 0.9 }} }}
checks.positive_data_acceptance.expected-statuses = {with_rules}

# The operation must be awaiting approval (else 422 today); its action must be in the actions
# file; an approver is not who asked (separate_approver); a denial needs a note.
[[operations]]
include-method = "POST"
include-path-regex = "^/v1/approvals/[{{]operation_id[}}]/(approve|deny)$"
checks.positive_data_acceptance.expected-statuses = {with_rules}

# A cursor is a next_cursor this API returned.
[[operations]]
include-method = "GET"
include-path = "/v1/operations"
checks.positive_data_acceptance.expected-statuses = {with_rules}

# A long-poll answers at once: no worker runs, so no outcome settles, and 60 s an example is no test.
[[operations]]
include-path = "/v1/operations/{{operation_id}}/wait"
parameters = {{ "query.timeout_s" = 0 }}
"""


@pytest.fixture
def served(pipe: Any, sandbox: Any) -> Iterator[tuple[Api, str]]:
    pipe.write_actions(actions_doc(sandbox.url, actions=ACTIONS))
    with _serve(pipe, OUTBOX_API_RATE_PER_S="100000") as api:
        key = _key(api.env, "fuzz", "submit,read,approve,operate")
        # Something to find: an operation of this tenant, and one awaiting approval.
        headers = {"Authorization": f"Bearer {key}"}
        ticket = _intent("fuzz-2", action="support.ticket.create", args={"subject": "printer on fire"})
        for intent in (_intent("fuzz-1"), ticket):
            httpx.post(f"{api.url}/v1/intents", json=intent, headers=headers, timeout=10).raise_for_status()
        yield api, key


def _refs(node: Any, at: str = "#") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for name, value in node.items():
            if name == "$ref" and isinstance(value, str):
                yield at, value
            else:
                yield from _refs(value, f"{at}/{name}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{at}/{i}")


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    """A JSON pointer within the document (RFC 6901); a reference elsewhere does not resolve."""
    if not ref.startswith("#/"):
        raise LookupError(f"{ref} points outside the document")
    node: Any = doc
    for token in ref[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


def test_every_reference_in_the_document_resolves(served: tuple[Api, str]) -> None:
    api, _ = served
    doc = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    refs = list(_refs(doc))
    unresolved = []
    for at, ref in refs:
        try:
            _resolve(doc, ref)
        except (LookupError, ValueError, IndexError) as exc:
            unresolved.append(f"{at}: {ref} ({type(exc).__name__})")
    assert not unresolved, unresolved
    assert len(refs) > 20
    # The bodies the routes read themselves are components like every other body.
    batch = doc["paths"]["/v1/intents:batch"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert _resolve(doc, batch["$ref"])["properties"]["intents"]["items"] == {"$ref": "#/components/schemas/IntentIn"}
    run = doc["paths"]["/v1/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert _resolve(doc, run["$ref"])["properties"]["steps"]["items"] == {"$ref": "#/components/schemas/StepIn"}
    # The status filter names the ledger's states, whatever they are.
    [status] = [p for p in doc["paths"]["/v1/operations"]["get"]["parameters"] if p["name"] == "status"]
    enums = [s["enum"] for s in _alternatives(doc, status["schema"]) if "enum" in s]
    assert enums == [[s.value for s in Status]], status


def _alternatives(doc: dict[str, Any], schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "$ref" in schema:
        yield from _alternatives(doc, _resolve(doc, schema["$ref"]))
    elif "anyOf" in schema:
        for option in schema["anyOf"]:
            yield from _alternatives(doc, option)
    else:
        yield schema


def test_errors_of_the_protocol_are_problems_the_document_names(served: tuple[Api, str]) -> None:
    api, key = served
    doc = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
        # RFC 9110: a 405 says which methods the resource has, for every path.
        for path, item in doc["paths"].items():
            concrete = path.replace("{operation_id}", "0").replace("{run_id}", "0").replace("{handoff_id}", "1")
            concrete = concrete.replace("{target}", "sandbox")
            r = c.request("PATCH", concrete)
            documented = {m.upper() for m in item}
            assert r.status_code == 405, (path, r.status_code, r.text)
            assert set(r.headers["allow"].split(", ")) == documented, (path, r.headers.get("allow"))
            assert r.headers["content-type"] == "application/problem+json" and r.json()["status"] == 405

        # A body that is not JSON is a 400 naming the body, whoever parses it; the document says so.
        for path in ("/v1/intents", "/v1/intents:batch", "/v1/runs", "/v1/breakers/sandbox/reset"):
            for raw, says in ((b'{"by": ', "not valid JSON"), (b'{"by": "\xc3\x28"}', "not UTF-8"), (b"", "empty")):
                r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, raw, r.status_code, r.text)
                problem = r.json()
                assert r.headers["content-type"] == "application/problem+json", (path, r.headers)
                assert problem["field"] == "body" and says in problem["detail"], (path, problem)
                assert problem["type"].endswith("/malformed-body")
        with_body = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items() if "requestBody" in op]
        assert len(with_body) >= 8
        for path, method, op in with_body:
            problem = op["responses"].get("400", {}).get("content", {}).get("application/problem+json")
            assert problem == {"schema": {"$ref": "#/components/schemas/Problem"}}, (method, path)

        # Every state the ledger has filters the list; anything else is refused naming the field.
        for status in Status:
            assert c.get("/v1/operations", params={"status": status.value}).status_code == 200, status
        bad = c.get("/v1/operations", params={"status": ""})
        assert bad.status_code == 422 and bad.json()["field"] == "status", bad.text


def test_what_the_document_forbids_is_refused_and_what_it_answers_it_documents(served: tuple[Api, str]) -> None:
    # Schemathesis found these (issue 55): a batch item's deadline_s past the document's maximum was
    # stored, a run's null priority read as 0; a denial's note is required, and now the document says so.
    api, key = served
    doc = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    deny = doc["paths"]["/v1/approvals/{operation_id}/deny"]["post"]["requestBody"]["content"]["application/json"]
    assert "note" in _resolve(doc, deny["schema"]["$ref"])["required"]
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
        too_long = _intent("fuzz-deadline", deadline_s=10 * 365 * 86400 + 1)
        r = c.post("/v1/intents:batch", json={"intents": [too_long]})
        assert r.status_code == 200, r.text
        [item] = r.json()["results"]
        assert (item["status"], item["problem"]["field"]) == (422, "intents.0.deadline_s"), item
        assert c.post("/v1/intents", json=too_long).json()["field"] == "deadline_s"
        assert c.get("/v1/operations", params={"idempotency_key": "fuzz-deadline"}).json()["operations"] == []
        r = c.post("/v1/intents", json=_intent("fuzz-null", priority=None))
        assert (r.status_code, r.json()["field"]) == (422, "priority"), r.text
        assert "must not be null; leave it out" in r.json()["detail"], r.text  # as POST /v1/runs says it
        step = {"name": "refund", "action": "payments.refund.create", "args": {"order_id": "o-1", "amount": "1.00"}}
        r = c.post("/v1/runs", json={"run_key": "fuzz-run", "steps": [step], "priority": None})
        assert (r.status_code, r.json()["field"]) == (422, "priority"), r.text
        assert "must not be null; leave it out" in r.json()["detail"], r.text
        r = c.post("/v1/approvals/0/deny", json={"by": "alice"})
        assert (r.status_code, r.json()["field"]) == (422, "note"), r.text


def test_schemathesis_finds_nothing_with_every_check_in_every_phase(served: tuple[Api, str], tmp_path: Path) -> None:
    api, key = served
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        SCHEMATHESIS_CONFIG.format(
            max_examples=MAX_EXAMPLES, actions=json.dumps(sorted(ACTIONS)), with_rules=WITH_RULES
        )
    )
    report = tmp_path / "report.json"
    started = time.monotonic()
    done = spawn.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{api.url}/openapi.json",
            "--checks",
            "all",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--report",
            "json",
            "--report-json-path",
            str(report),
            "--no-color",
        ],
        env=dict(os.environ) | {"FUZZ_KEY": key},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took_s = time.monotonic() - started
    out = done.stdout + done.stderr
    (tmp_path / "schemathesis.txt").write_text(out)  # the whole report, kept with the test's files
    assert done.returncode == 0, out[-20_000:]
    summary = json.loads(report.read_text())
    assert (summary["failures"], summary["errors"], summary["stop_reason"]) == ([], [], "completed"), summary
    assert {phase: v["status"] for phase, v in summary["phases"].items()} == dict.fromkeys(
        ("examples", "coverage", "fuzzing", "stateful"), "success"
    ), summary["phases"]
    assert summary["operations"]["tested"] == summary["operations"]["total"] >= 20
    assert summary["warnings"]["unresolvable_reference"] == []
    # The stateful phase followed the document's links (an intent's id to its reads, wait, cancel
    # and approval; a run's to its read and cancel), not only the ones schemathesis guessed.
    # The count is what this deterministic run reaches: 8 before the intent body gained `priority`
    # (the same seedless generation then takes another path), 7 since, 6 since the handoff and webhook
    # operations (issues 50, 51) joined the document; a drop below means the links
    # of the document stopped being followed.
    covered = re.search(r"API Links:\s+(\d+) covered", out)
    assert covered is not None and int(covered.group(1)) >= 6, out[-5000:]
    print(f"schemathesis: {summary['test_cases']['generated']} test cases in {took_s:.1f} s")
