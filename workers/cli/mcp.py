"""``agent-outbox mcp``: the actions as MCP tools, over stdio (default) or streamable HTTP."""

from __future__ import annotations

import argparse
from typing import Any

from outbox.errors import ConfigError, InvalidIntent
from outbox.settings import load_settings
from workers.cli.ledger import open_engine
from workers.ground import logs


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("mcp", help="serve the actions as MCP tools (stdio, or --http with API keys)")
    p.add_argument("--http", action="store_true", help="streamable HTTP on --host/--port (path /mcp) instead of stdio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--tenant", help="stdio: the tenant of every call (default OUTBOX_DEFAULT_TENANT); HTTP: the key's")
    p.add_argument("--subject", default="mcp", help="who asks, as recorded on each intent (default: mcp)")
    p.add_argument(
        "--scope",
        default="mcp",
        help="the key scope when a request's _meta has no 'agent-outbox/scope' (a host's conversation id)",
    )
    p.set_defaults(func=cmd_mcp)


def cmd_mcp(args: argparse.Namespace) -> int:
    try:
        import anyio
        from mcp.server.stdio import stdio_server

        from producer.agents.calls import ToolCaller
        from producer.agents.mcp_server import CALLER_KEY, BearerKeys, build_server, key_callers
    except ImportError as exc:
        raise InvalidIntent(
            "mcp", f"the MCP server needs its extra: pip install 'agent-outbox-ledger[mcp]' ({exc})"
        ) from exc
    from outbox.actions.rules import load_action_rules
    from producer.client import Outbox

    settings = load_settings()
    if settings.actions_file is None:
        raise ConfigError("OUTBOX_ACTIONS_FILE is not set: the MCP server serves the actions of that file as tools")
    rules = load_action_rules(settings.actions_file)
    # Over HTTP, agents call at once: the API server's kept connections, not a new backend every few calls.
    engine = open_engine(settings, serving=args.http)
    outbox = Outbox(engine, rules=rules)
    tools = list(ToolCaller(outbox, rules, tenant="-", subject=args.subject).tools.values())
    try:
        if not args.http:
            caller = ToolCaller(outbox, rules, tenant=args.tenant or settings.default_tenant, subject=args.subject)
            server = build_server(lambda ctx: caller, default_scope=args.scope, tools=tools)

            async def serve_stdio() -> None:
                async with stdio_server() as (read, write):
                    await server.run(read, write, server.create_initialization_options())

            anyio.run(serve_stdio)
            return 0
        import uvicorn

        def caller_for(ctx: Any) -> ToolCaller:
            found = ctx.request.scope.get(CALLER_KEY) if ctx.request is not None else None
            if found is None:
                raise ConfigError("no caller on this request")
            return found  # type: ignore[no-any-return]

        server = build_server(caller_for, default_scope=args.scope, tools=tools)
        app = BearerKeys(server.streamable_http_app(host=args.host), key_callers(outbox, rules))
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **logs.uvicorn_logging())
        return 0
    finally:
        outbox.close()
