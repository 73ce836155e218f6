"""The OpenAI Agents SDK with an agent-outbox tool, offline (the SDK's scripted model, the sandbox).

    python examples/agents/openai_agents_refund.py

The scripted model asks for a refund, then asks again (a model retry, with a new call id): the tool
answers the same operation, "already done", and the provider makes one refund. Then the same action
with an approval rule: the run pauses in the SDK's interruption flow, a person approves
(``tools.approve(state, item, by=...)``, written as an agent-outbox approval), the run resumes.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from agents import Agent, Runner, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline import REFUND, offline  # noqa: E402

from producer.agents.openai_agents import OutboxTools, tool_name  # noqa: E402

ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


@dataclass
class Conversation:
    conversation_id: str  # the host's id: the scope of every tool call's key


def answers(result: object) -> list[dict[str, object]]:
    return [json.loads(i.output) for i in result.new_items if i.type == "tool_call_output_item"]  # type: ignore[attr-defined]


def main() -> int:
    set_tracing_disabled(True)  # offline: no trace export
    name = tool_name(REFUND)
    with offline() as (caller, sandbox):
        tools = OutboxTools(caller, scope=lambda ctx: ctx.conversation_id, wait_s=20)
        model = ScriptedModel(
            [
                [function_call(name, ARGS, call_id="call-1")],
                [function_call(name, ARGS, call_id="call-2")],  # the model retries
                [assistant_message("The refund is done.")],
            ]
        )
        agent = Agent(name="support", model=model, tools=[tools.tool(REFUND)])
        result = asyncio.run(Runner.run(agent, "Refund order o-81", context=Conversation("conv-1")))
        for answer in answers(result):
            print(f"tool answered {answer['outcome']}: {answer['model_message']}")
        print("refunds the provider made:", len(sandbox.effects()))

    with offline(approval={"required": "always", "ttl_s": 600}) as (caller, sandbox):
        tools = OutboxTools(caller, scope=lambda ctx: ctx.conversation_id, wait_s=20)
        model = ScriptedModel([[function_call(name, ARGS, call_id="call-1")], [assistant_message("Refunded.")]])
        agent = Agent(name="support", model=model, tools=[tools.tool(REFUND)])
        paused = asyncio.run(Runner.run(agent, "Refund order o-81", context=Conversation("conv-2")))
        print("paused for approval:", len(paused.interruptions), "call(s); sent:", len(sandbox.requests(method="POST")))
        state = paused.to_state()
        tools.approve(state, paused.interruptions[0], by="you", note="checked")
        resumed = asyncio.run(Runner.run(agent, state))
        print("after approval:", answers(resumed)[0]["model_message"])
        print("refunds the provider made:", len(sandbox.effects()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
