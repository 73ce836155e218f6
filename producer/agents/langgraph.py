"""The LangGraph helper: a node that asks for one action, at most once, whatever the graph replays.

    graph.add_node("refund", outbox_node(caller, "payments.refund.create", args_from=lambda s: s["refund"]))

The node's call is keyed by the graph's ``thread_id`` (producer/agents/calls.py), so a node re-executed
after an interrupt, a crash or a resume from the checkpointer finds the same operation instead of
acting again. An action whose ``approval:`` rule covers the call pauses the graph with
``interrupt({...})`` showing the operation and its exact arguments; resume it with
``Command(resume={"operation_id": ..., "approved": True, "by": "alice", "note": ...})`` (or
``"approved": False``; a resume naming another operation is asked again): the decision is written as an agent-outbox approval (who, when, under which
policy). The node returns ``{result_key: {outcome, model_message, operation_id, reference, ...}}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.types import interrupt

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import canonical_value, dumps_canonical
from producer.agents.call_keys import exact
from producer.agents.calls import ToolAnswer, ToolCaller
from producer.agents.catalog import RESERVED

Node = Callable[[Any, RunnableConfig], dict[str, Any]]


def thread_scope(config: RunnableConfig) -> str:
    thread = (config.get("configurable") or {}).get("thread_id")
    if not thread:
        raise InvalidIntent(
            "thread_id", "run the graph with a checkpointer and config={'configurable': {'thread_id': ...}}"
        )
    return str(thread)


def outbox_node(
    caller: ToolCaller,
    action: str,
    *,
    args_from: Callable[[Any], Mapping[str, Any]],
    result_key: str = "outbox",
    wait_s: float = 20.0,
) -> Node:
    """A graph node: ``args_from(state)`` gives the action's arguments; the answer lands in
    ``state[result_key]``. ``wait_s``: how long the node waits for a settled outcome. ``args_from``
    may add ``occurrence`` (2, 3, ... or a label: producer/agents/calls.py), only to make another
    one of the same call: a second node asking for the same arguments on purpose."""

    def node(state: Any, config: RunnableConfig) -> dict[str, Any]:
        args = dict(args_from(state))
        answer = caller.call(action, args, scope=thread_scope(config))
        # A conflict is another call's operation (the same reference, other arguments): it is answered,
        # never approved on this call's behalf.
        if answer.status == "awaiting_approval" and not answer.conflict:
            question = _question(answer, args)
            decision = interrupt(question)
            while not _for(decision, answer):  # a resume meant for another operation: ask again
                decision = interrupt(question | {"error": f"resume with operation_id {answer.operation_id}"})
            answer = _decide(caller, answer, decision)
        if not answer.settled and wait_s > 0:
            answer = caller.wait(answer.stored_id, timeout_s=wait_s, replay=not answer.new)
        return {result_key: answer.as_dict()}

    return node


def _question(answer: ToolAnswer, args: dict[str, Any]) -> dict[str, Any]:
    """What the interrupt shows the person (and the host's UI): the operation and its exact arguments."""
    return {
        "kind": "agent-outbox approval",
        "operation_id": answer.operation_id,
        "action": answer.action,
        # Canonical JSON text: what would be sent (never ``occurrence`` or ``retry_of``: the call's own).
        "args": dumps_canonical(canonical_value(exact({k: v for k, v in args.items() if k not in RESERVED}))),
        "idempotency_key": answer.idempotency_key,
        "message": answer.model_message,
        "resume_with": {"operation_id": answer.operation_id, "approved": "true|false", "by": "who", "note": "why"},
    }


def _for(decision: Any, answer: ToolAnswer) -> bool:
    """The decision names this node's operation: a resume from before the state changed (an edited
    amount makes another operation) is never applied to an operation nobody saw."""
    return isinstance(decision, Mapping) and decision.get("operation_id") == answer.operation_id


def _decide(caller: ToolCaller, answer: ToolAnswer, decision: Any) -> ToolAnswer:
    if not isinstance(decision, Mapping) or not isinstance(decision.get("approved"), bool) or not decision.get("by"):
        raise InvalidIntent(
            "resume", 'resume with Command(resume={"approved": true|false, "by": "alice", "note": "..."})'
        )
    if decision["approved"]:
        caller.approve(answer.stored_id, by=str(decision["by"]), note=decision.get("note"))
    else:
        caller.deny(answer.stored_id, by=str(decision["by"]), note=str(decision.get("note") or "denied"))
    return caller.get(answer.stored_id)
