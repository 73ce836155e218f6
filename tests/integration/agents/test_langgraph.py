"""The LangGraph helper (issue 19): a graph interrupted for approval and resumed from its SQLite
checkpointer in a new process makes one effect; the graph run again on its thread makes none.
Each phase is a separate process (examples/agents/langgraph_approval.py) on the test's PostgreSQL
ledger, with real workers, relay, Redis and the sandbox, which counts the effects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import action, actions_doc, pk

pytest.importorskip("langgraph.checkpoint.sqlite")
pytestmark = [pytest.mark.postgres, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "agents" / "langgraph_approval.py"
REFUND = "payments.refund.create"


def _phase(pipe: Any, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=ROOT,
        env=dict(os.environ) | pipe.env | {"EXAMPLE_TENANT": "t1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_interrupted_for_approval_resumed_in_a_new_process_one_effect(pipe, sandbox, tmp_path):
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"reference_args": ["order_id"]}
    refund["approval"] = {"required": "always", "ttl_s": 600, "policy_version": "refunds-v1"}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    pipe.start_worker()
    pipe.start_relay()
    checkpoints = str(tmp_path / "checkpoints.sqlite")

    paused = _phase(pipe, "start", "thread-7", checkpoints)
    [question] = paused["interrupts"]
    assert question["kind"] == "agent-outbox approval" and question["action"] == REFUND
    assert sandbox.requests(method="POST") == []  # nothing sent while the graph waits

    resumed = _phase(pipe, "resume", "thread-7", checkpoints, "alice")  # a new process, from the checkpointer
    assert resumed["outbox"]["outcome"] == "SUCCEEDED", resumed
    assert resumed["outbox"]["operation_id"] == question["operation_id"]
    again = _phase(pipe, "start", "thread-7", checkpoints)  # the graph run again on its thread
    assert again["interrupts"] == [] and again["outbox"]["operation_id"] == question["operation_id"]

    key = f'thread-7:{REFUND}:ref="o-81"'
    assert len(sandbox.effects(key=pk(key))) == 1 and len(sandbox.effects()) == 1
    shown = pipe.op(question["operation_id"])
    assert shown.status == "succeeded"
    from outbox.approvals import decisions as approvals

    with pipe.sessions() as s:
        [record] = approvals.history(s, question["operation_id"])
    assert (record.approver, record.decision, record.policy_version) == ("alice", "approved", "refunds-v1")


def test_a_resume_naming_another_operation_is_asked_again_and_approves_nothing(pipe, sandbox):
    """The person's decision is bound to the operation they were shown: a resume carrying another
    operation id (a stale screen, an edited state) pauses the graph again; nothing is approved."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command

    sys.path.insert(0, str(EXAMPLE.parent))
    from langgraph_approval import build  # type: ignore[import-not-found]

    from outbox.actions.rules import load_action_rules
    from outbox.approvals import decisions as approvals
    from producer.agents.calls import ToolCaller
    from producer.client import Outbox

    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"reference_args": ["order_id"]}
    refund["approval"] = {"required": "always", "ttl_s": 600}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    caller = ToolCaller(Outbox(pipe.sessions.kw["bind"], rules=rules), rules, tenant="t1", subject="agent:x")
    graph, config = build(caller, InMemorySaver()), {"configurable": {"thread_id": "thread-8"}}
    first = graph.invoke({"order_id": "o-81", "amount": "12.50"}, config)
    [question] = [i.value for i in first["__interrupt__"]]
    stale = graph.invoke(Command(resume={"operation_id": "someone-else", "approved": True, "by": "bob"}), config)
    [again] = [i.value for i in stale["__interrupt__"]]
    assert again["operation_id"] == question["operation_id"] and "resume with operation_id" in again["error"]
    with pipe.sessions() as s:
        assert approvals.history(s, question["operation_id"]) == []
    assert pipe.op(question["operation_id"]).status == "awaiting_approval"
    decision = {"operation_id": question["operation_id"], "approved": False, "by": "bob", "note": "not this one"}
    graph.invoke(Command(resume=decision), config)
    assert pipe.op(question["operation_id"]).status == "cancelled" and sandbox.requests(method="POST") == []
