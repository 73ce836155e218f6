"""The OpenAI Agents SDK helper (issue 19) with the SDK's own Runner and its scripted model (no network):
a model that calls the tool twice makes one effect; an approval-gated action pauses the run in the
SDK's interruption flow, and the approval, written as an agent-outbox approval, resumes it. Real
workers, relay, PostgreSQL, Redis and the sandbox, which counts the effects."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

from tests.harness import action, actions_doc

agents = pytest.importorskip("agents")
from agents import Agent, Runner  # noqa: E402
from agents.testing import ScriptedModel, assistant_message, function_call  # noqa: E402

from outbox.actions.rules import load_action_rules  # noqa: E402
from producer.agents.calls import ToolCaller  # noqa: E402
from producer.agents.openai_agents import OutboxTools  # noqa: E402
from producer.client import Outbox  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


@dataclass
class Conversation:
    conversation_id: str


def _tools(pipe: Any, sandbox: Any, **approval: Any) -> OutboxTools:
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"description": "Refund an order.", "reference_args": ["order_id"]}
    if approval:
        refund["approval"] = approval
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    caller = ToolCaller(Outbox(pipe.sessions.kw["bind"], rules=rules), rules, tenant="t1", subject="agent:support")
    return OutboxTools(caller, scope=lambda ctx: ctx.conversation_id, wait_s=20)


def _outputs(result: Any) -> list[dict[str, Any]]:
    return [json.loads(item.output) for item in result.new_items if item.type == "tool_call_output_item"]


def test_a_model_that_calls_the_tool_twice_makes_one_effect(pipe, sandbox):
    tools = _tools(pipe, sandbox)
    pipe.start_worker()
    pipe.start_relay()
    model = ScriptedModel(
        [
            [function_call("payments_refund_create", ARGS, call_id="call-1")],
            # The model retries (a new call id, the same refund): the same operation answers.
            [function_call("payments_refund_create", ARGS, call_id="call-2")],
            [assistant_message("Refunded.")],
        ]
    )
    agent = Agent(name="support", model=model, tools=[tools.tool(REFUND)])
    result = asyncio.run(Runner.run(agent, "refund order o-81", context=Conversation("conv-7")))
    first, second = _outputs(result)
    assert first["outcome"] == "SUCCEEDED" and first["new"] is True, first
    assert second["operation_id"] == first["operation_id"] and second["new"] is False
    assert "Already done" in second["model_message"]
    assert len(sandbox.effects()) == 1 and result.final_output == "Refunded."


def test_an_approval_gated_action_pauses_the_run_and_the_approval_resumes_it(pipe, sandbox):
    tools = _tools(pipe, sandbox, required="always", ttl_s=600, policy_version="refunds-v3")
    pipe.start_worker()
    pipe.start_relay()
    model = ScriptedModel(
        [[function_call("payments_refund_create", ARGS, call_id="call-1")], [assistant_message("Refunded.")]]
    )
    agent = Agent(name="support", model=model, tools=[tools.tool(REFUND)])
    paused = asyncio.run(Runner.run(agent, "refund order o-81", context=Conversation("conv-8")))
    [item] = paused.interruptions
    assert sandbox.requests(method="POST") == []  # nothing sent while the run waits

    state = paused.to_state()
    decided = tools.approve(state, item, by="alice", note="checked the order")
    assert decided.status in ("not_dispatched", "dispatching", "succeeded")
    resumed = asyncio.run(Runner.run(agent, state))
    [answer] = _outputs(resumed)
    assert answer["outcome"] == "SUCCEEDED" and answer["operation_id"] == decided.operation_id, answer
    assert resumed.final_output == "Refunded." and len(sandbox.effects()) == 1
    from outbox.approvals import decisions as approvals

    with pipe.sessions() as s:
        [record] = approvals.history(s, decided.operation_id)
    assert (record.approver, record.decision, record.policy_version) == ("alice", "approved", "refunds-v3")


def test_a_rejection_is_written_down_and_nothing_is_sent(pipe, sandbox):
    tools = _tools(pipe, sandbox, required="always", ttl_s=600)
    pipe.start_worker()
    pipe.start_relay()
    model = ScriptedModel(
        [[function_call("payments_refund_create", ARGS, call_id="call-1")], [assistant_message("Not refunded.")]]
    )
    agent = Agent(name="support", model=model, tools=[tools.tool(REFUND)])
    paused = asyncio.run(Runner.run(agent, "refund order o-81", context=Conversation("conv-9")))
    state = paused.to_state()
    denied = tools.reject(state, paused.interruptions[0], by="bob", note="duplicate request")
    assert denied.outcome == "CANCELLED"
    resumed = asyncio.run(Runner.run(agent, state))
    assert resumed.final_output == "Not refunded." and sandbox.requests(method="POST") == []
