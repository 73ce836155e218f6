"""A LangGraph graph whose refund needs a person's approval, interrupted and resumed (offline).

    python examples/agents/langgraph_approval.py            # the whole story in one process

It builds a graph START -> refund -> END whose refund node is ``outbox_node``: the node submits the
refund (keyed by the graph's thread id, so a replayed node never refunds twice), the action's approval
rule pauses the graph with ``interrupt()``, and ``Command(resume={"approved": True, "by": ...})``
writes the approval and lets it run. The checkpointer is SQLite on disk: the two phases can run in two
processes (``start THREAD CHECKPOINTS`` then ``resume THREAD CHECKPOINTS BY``), as the tests do.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, TypedDict

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline import REFUND, offline  # noqa: E402

from producer.agents.calls import ToolCaller  # noqa: E402
from producer.agents.langgraph import outbox_node  # noqa: E402

APPROVAL = {"required": "always", "ttl_s": 600, "policy_version": "refunds-v1"}


class State(TypedDict, total=False):
    order_id: str
    amount: str
    outbox: dict[str, Any]


def build(caller: ToolCaller, checkpointer: Any) -> Any:
    graph = StateGraph(State)
    args = lambda s: {"order_id": s["order_id"], "amount": s["amount"], "currency": "EUR"}  # noqa: E731
    graph.add_node("refund", outbox_node(caller, REFUND, args_from=args))
    graph.add_edge(START, "refund")
    graph.add_edge("refund", END)
    return graph.compile(checkpointer=checkpointer)


def start(caller: ToolCaller, thread: str, checkpoints: str) -> dict[str, Any]:
    with SqliteSaver.from_conn_string(checkpoints) as saver:
        out = build(caller, saver).invoke(
            {"order_id": "o-81", "amount": "12.50"}, {"configurable": {"thread_id": thread}}
        )
    return {"interrupts": [i.value for i in out.get("__interrupt__", [])], "outbox": out.get("outbox")}


def resume(caller: ToolCaller, thread: str, checkpoints: str, by: str) -> dict[str, Any]:
    config: Any = {"configurable": {"thread_id": thread}}
    with SqliteSaver.from_conn_string(checkpoints) as saver:
        graph = build(caller, saver)
        [waiting] = graph.get_state(config).interrupts  # what the person is shown: operation and arguments
        decision = {"operation_id": waiting.value["operation_id"], "approved": True, "by": by, "note": "checked"}
        out = graph.invoke(Command(resume=decision), config)
    return {"outbox": out.get("outbox")}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("start", "resume"):
        with offline(approval=APPROVAL) as (caller, _):
            done = start(caller, argv[1], argv[2]) if argv[0] == "start" else resume(caller, *argv[1:4])
        print(json.dumps(done))
        return 0
    with offline(approval=APPROVAL) as (caller, sandbox), tempfile.TemporaryDirectory() as tmp:
        checkpoints = str(Path(tmp) / "checkpoints.sqlite")
        paused = start(caller, "thread-1", checkpoints)
        print("paused for approval:", paused["interrupts"][0]["message"])
        print("nothing sent yet:", sandbox.requests(method="POST") == [])
        done = resume(caller, "thread-1", checkpoints, by="you")
        print("after approval:", done["outbox"]["outcome"], "-", done["outbox"]["model_message"])
        again = start(caller, "thread-1", checkpoints)  # the graph run again on its thread: no second refund
        print("run again:", again["outbox"]["model_message"])
        print("refunds the provider made:", len(sandbox.effects()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
