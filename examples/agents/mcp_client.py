"""An MCP host's view of agent-outbox, offline: the official SDK's client starts ``agent-outbox mcp``
over stdio, lists the tools and calls the refund tool twice.

    python examples/agents/mcp_client.py

The second call (a model retry) answers the same operation, "already done"; the provider makes one
refund. A host passes its conversation id as ``_meta["agent-outbox/scope"]``: the key's scope.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from mcp import Client
from mcp.client.stdio import StdioServerParameters

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline import REFUND, offline  # noqa: E402

ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR", "reason": "damaged"}
META = {"agent-outbox/scope": "conversation-1"}


async def host() -> None:
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "workers.cli.main", "mcp", "--tenant", "demo"],
        env=dict(os.environ),
        cwd=str(ROOT),
    )
    async with Client(server, read_timeout_seconds=30) as client:
        tools = (await client.list_tools()).tools
        print("tools:", ", ".join(t.name for t in tools))
        first = await client.call_tool(REFUND, ARGS, meta=META)
        print("first call:", first.structured_content["outcome"], "-", first.content[0].text)
        operation = first.structured_content["operation_id"]
        done = await client.call_tool("wait_operation", {"operation_id": operation, "timeout_s": 20}, meta=META)
        print("waited:", done.content[0].text)
        again = await client.call_tool(REFUND, ARGS, meta=META)
        print("the same call again:", again.content[0].text)


def main() -> int:
    with offline() as (_, sandbox):
        anyio.run(host)
        print("refunds the provider made:", len(sandbox.effects()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
