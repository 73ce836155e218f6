"""The OpenAI Agents SDK helper: an action of the actions file as a function tool.

    tools = OutboxTools(caller, scope=lambda ctx: ctx.conversation_id)   # your run context's id
    agent = Agent(name="support", tools=[tools.tool("payments.refund.create")])

Each call is submitted as an intent whose key is ``{scope}:{action}:...`` (producer/agents/calls.py), so a
model that calls the tool twice (a retry, a resumed run) gets the same operation's outcome, never a
second effect. The tool answers with JSON: ``outcome``, ``model_message``, ``operation_id``,
``reference``.

Approval: an action whose ``approval:`` rule covers the call is a tool with ``needs_approval``, so the
run pauses in the SDK's own interruption flow. Decide with ``tools.approve(state, item, by="alice")``
(or ``tools.reject(...)``): the decision is written as an agent-outbox approval (who, when, under which
policy) before the SDK is told, and the resumed run's tool call finds the approved operation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agents import FunctionTool, RunContextWrapper, RunState, ToolApprovalItem
from agents.tool_context import ToolContext

from outbox.errors import InvalidIntent, OutboxError
from producer.agents.calls import ToolAnswer, ToolCaller
from producer.agents.catalog import tool_for

Scope = Callable[[Any], str]


def tool_name(action: str) -> str:
    """The SDK's function names allow letters, digits, _ and -: payments.refund.create -> payments_refund_create."""
    return action.replace(".", "_")


class OutboxTools:
    """Function tools over one ToolCaller. ``scope(context)``: the host's id for this conversation or
    run, from the run context object you pass to ``Runner.run(..., context=...)``. ``wait_s``: how long a
    call waits for a settled outcome before it answers (0: answer at once, usually PENDING)."""

    def __init__(self, caller: ToolCaller, *, scope: Scope, wait_s: float = 0.0) -> None:
        self.caller, self.scope, self.wait_s = caller, scope, wait_s
        self._actions: dict[str, str] = {}

    def tool(self, action: str, *, name: str | None = None) -> FunctionTool:
        view = tool_for(self.caller.tools, action)
        fn_name = name or tool_name(action)
        self._actions[fn_name] = action

        async def invoke(ctx: ToolContext[Any], raw: str) -> str:
            try:
                args = json.loads(raw or "{}")
                answer = await asyncio.to_thread(self._call, action, args, self.scope(ctx.context), ctx.tool_call_id)
            except (OutboxError, ValueError) as exc:
                return json.dumps({"error": "invalid", "message": f"{exc}. Nothing was submitted; correct the call."})
            return json.dumps(answer.as_dict())

        async def needs_approval(ctx: RunContextWrapper[Any], params: dict[str, Any], call_id: str) -> bool:
            try:
                if not view.needs_approval(params):
                    return False
                # Decided already (a repeated call, a resumed run): the operation goes its way, no new pause.
                existing = await asyncio.to_thread(self.caller.find, action, params, scope=self.scope(ctx.context))
            except (OutboxError, ValueError, TypeError):
                return False  # the call itself refuses the same input, and submits nothing
            return existing is None or existing.status == "awaiting_approval"

        return FunctionTool(
            name=fn_name,
            description=view.description,
            params_json_schema=view.input_schema,
            on_invoke_tool=invoke,
            strict_json_schema=False,
            needs_approval=needs_approval if view.may_need_approval else False,
        )

    def tools(self, *actions: str) -> list[FunctionTool]:
        return [self.tool(a) for a in actions or tuple(self.caller.tools)]

    # -- a person's decision, written down before the SDK hears it -----------------------------
    def approve(self, state: RunState[Any], item: ToolApprovalItem, *, by: str, note: str | None = None) -> ToolAnswer:
        """Approve the interrupted call: its own operation (submitted now, waiting), bound to the
        arguments the person saw. Raises InvalidIntent when the call stands for another operation
        (the same reference, other arguments: approving would send what nobody saw) or when the
        operation was decided elsewhere."""
        answer = self._submit_for(state, item)
        if answer.conflict:
            raise InvalidIntent(
                "approval",
                f"this call's arguments differ from those of operation {answer.operation_id} for the same "
                "reference: nothing to approve here; reject the call",
            )
        if answer.status == "awaiting_approval":
            self.caller.approve(answer.stored_id, by=by, note=note)
        elif answer.status == "cancelled":
            raise InvalidIntent("approval", f"operation {answer.operation_id} was denied or cancelled already")
        state.approve(item)
        return self.caller.get(answer.stored_id)

    def reject(self, state: RunState[Any], item: ToolApprovalItem, *, by: str, note: str) -> ToolAnswer | None:
        """Deny the interrupted call (written down: who, when, why; nothing sent). Returns the
        operation, or None when the call never made one (invalid input)."""
        try:
            answer = self._submit_for(state, item)
        except OutboxError:
            state.reject(item, rejection_message=f"Rejected by {by}: {note}. Nothing was sent.")
            return None
        if answer.conflict:  # the call stands for another operation: that one is not this person's to deny
            state.reject(item, rejection_message=f"Rejected by {by}: {note}. {answer.model_message}")
            return answer
        if answer.status == "awaiting_approval":
            self.caller.deny(answer.stored_id, by=by, note=note)
        elif answer.status != "cancelled":
            raise InvalidIntent(
                "reject", f"operation {answer.operation_id} is {answer.status}: it was approved elsewhere already"
            )
        after = self.caller.get(answer.stored_id)
        state.reject(item, rejection_message=after.model_message)
        return after

    # -- internals ----------------------------------------------------------------------------
    def _call(self, action: str, args: dict[str, Any], scope: str, tool_call_id: str | None) -> ToolAnswer:
        answer = self.caller.call(action, args, scope=scope, tool_call_id=tool_call_id)
        if self.wait_s <= 0 or answer.settled:
            return answer
        waited = self.caller.wait(answer.stored_id, timeout_s=self.wait_s, replay=not answer.new)
        return replace(waited, new=answer.new, conflict=answer.conflict, model_message=waited.model_message)

    def _submit_for(self, state: RunState[Any], item: ToolApprovalItem) -> ToolAnswer:
        """The intent of an interrupted call (submitted now if the run had not reached it: it then
        waits in awaiting_approval, nothing sent), so the decision is bound to its exact arguments."""
        action = self._actions.get(item.tool_name or "") or (item.tool_name or "")
        raw = getattr(item.raw_item, "arguments", None) or "{}"
        context = state._context.context if state._context is not None else None  # noqa: SLF001 - the run's own context
        return self.caller.call(action, json.loads(raw), scope=self.scope(context))
