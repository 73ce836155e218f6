"""The MCP server (``agent-outbox mcp``): every action of the actions file as a tool, plus
``get_operation`` and ``wait_operation``, over stdio or streamable HTTP (official ``mcp`` SDK, v2).

A tool call is submitted as an intent (producer/agents/calls.py: its key is the host's scope, the action
and the call's reference or arguments, so the same call again is the same operation) and answered at
once with its typed outcome: ``structuredContent`` carries ``outcome``, ``operation_id``,
``model_message`` and the provider's reference, and a text part says ``model_message``. Over HTTP
every request carries an API key (``Authorization: Bearer``, as ``agent-outbox keys create``
makes them, scope ``submit``); its tenant is the tenant of every call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox.access.keys import verify
from outbox.actions.rules import ActionRules
from outbox.errors import OutboxError
from outbox.ledger.typed_outcome import Outcome, Stage
from outbox.service import waiting
from outbox.service.waiting import MAX_WAIT_S
from producer.agents.calls import ToolAnswer, ToolCaller
from producer.agents.catalog import ToolView
from producer.agents.mcp_tasks import TasksExtension, install
from producer.client import Outbox

SCOPE_META = "agent-outbox/scope"  # a host's conversation or run id, in a request's _meta
# The host's priority for a call (-100..100, higher is claimed sooner), in a request's _meta. Not a
# tool argument: an action may have a business argument of that name (a ticket's priority), and a
# call's place in the queue is the host's to set, not the model's.
PRIORITY_META = "agent-outbox/priority"
# W3C trace context in a request's _meta (the MCP convention for OpenTelemetry propagation): stored
# with the intent, so its spans continue the host's trace.
TRACEPARENT_META = "traceparent"
CALLER_KEY = "agent_outbox.caller"  # where the HTTP auth puts the caller's ToolCaller (ASGI scope)

ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "outcome": {
            "type": "string",
            "enum": [o.value for o in Outcome],
        },
        # With PENDING: QUEUED (nothing sent yet), IN_PROGRESS, ACCEPTED (by the provider, not finished).
        "stage": {"type": ["string", "null"], "enum": [*(s.value for s in Stage), None]},
        "model_message": {"type": "string"},
        "operation_id": {"type": ["string", "null"]},
        "status": {"type": "string"},
        "action": {"type": "string"},
        "idempotency_key": {"type": "string"},
        "reference": {"type": ["string", "null"]},
        "new": {"type": "boolean"},
        "conflict": {"type": "boolean"},
        "budget": {"type": ["object", "null"]},
        "waiting_on": {"type": ["object", "null"]},
    },
    "required": ["outcome", "model_message", "operation_id", "status"],
}
_OPERATION_ARGS = {"operation_id": {"type": "string", "description": "the operation_id a tool call answered"}}


def _tool(view: ToolView) -> types.Tool:
    return types.Tool(
        name=view.action,
        description=view.description,
        input_schema=view.input_schema,
        output_schema=ANSWER_SCHEMA,
        annotations=types.ToolAnnotations(
            title=view.action,
            read_only_hint=False,
            destructive_hint=view.destructive,  # tool.destructive, default true: a host should ask
            idempotent_hint=True,  # the same call again is the same operation, never a second effect
            open_world_hint=True,  # it reaches a business system outside the host
        ),
        execution=types.ToolExecution(task_support="optional"),  # MCP Tasks: producer/agents/mcp_tasks.py
    )


READ_TOOLS = [
    types.Tool(
        name="get_operation",
        description="The outcome of an operation a tool call started, as it is now.",
        input_schema={"type": "object", "properties": _OPERATION_ARGS, "required": ["operation_id"]},
        output_schema=ANSWER_SCHEMA,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
    ),
    types.Tool(
        name="wait_operation",
        description=(
            "Wait until an operation's outcome is settled (final, or a person is needed), at most timeout_s "
            f"seconds (<= {MAX_WAIT_S:g}); then its outcome as it is."
        ),
        input_schema={
            "type": "object",
            "properties": {**_OPERATION_ARGS, "timeout_s": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S}},
            "required": ["operation_id"],
        },
        output_schema=ANSWER_SCHEMA,
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False),
    ),
]


def answered(answer: ToolAnswer) -> types.CallToolResult:
    """A tool's answer; a REFUSED one (nothing stored: a budget, a busy object) is a tool error the
    model reads, with what is left or what it waits behind."""
    return types.CallToolResult(
        content=[types.TextContent(text=answer.model_message)],
        structured_content=answer.as_dict(),
        is_error=answer.outcome == Outcome.REFUSED.value,
    )


def refused(exc: OutboxError) -> types.CallToolResult:
    field = getattr(exc, "field", None)
    text = f"Invalid input ({field}): {getattr(exc, 'reason', exc)}" if field else f"Refused: {exc}"
    return types.CallToolResult(
        content=[types.TextContent(text=text + ". Nothing was submitted; correct the call and try again.")],
        is_error=True,
    )


def busy() -> types.CallToolResult:
    """Every database connection of this server process stayed in use for the pool's whole wait
    (OUTBOX_API_DB_CONNECTIONS): the call may not have reached the ledger. The same call again is
    safe: a call already made is found under its key, not made twice."""
    text = (
        "Busy: every database connection of this server stayed in use, and the call may not have been "
        "made. Call again with the same arguments: one that was made is answered, never made twice."
    )
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def dispatch(
    caller: ToolCaller,
    name: str,
    arguments: Mapping[str, Any],
    scope: str,
    priority: Any = 0,
    traceparent: Any = None,
) -> types.CallToolResult:
    """A tool call or a read, on a worker thread (the ledger calls block)."""
    try:
        if name == "get_operation":
            return answered(caller.get(str(arguments.get("operation_id", ""))))
        return answered(caller.call(name, dict(arguments), scope=scope, priority=priority, traceparent=traceparent))
    except OutboxError as exc:
        return refused(exc)
    except PoolTimeout:
        return busy()


async def wait_for_outcome(caller: ToolCaller, arguments: Mapping[str, Any]) -> types.CallToolResult:
    """wait_operation: waits on the event loop (outbox.service.waiting.wait_async), holding a worker
    thread only for each read (a long wait must not take a thread that other calls and other
    tenants need)."""
    operation_id = str(arguments.get("operation_id", ""))
    try:
        timeout_s = waiting.timeout_of(arguments.get("timeout_s", 30))
        answer = await anyio.to_thread.run_sync(caller.get, operation_id)
        if answer.settled or not timeout_s:
            return answered(answer)
        await waiting.wait_async(caller.outbox.sessions, operation_id, timeout_s=timeout_s)
        return answered(await anyio.to_thread.run_sync(caller.get, operation_id))
    except OutboxError as exc:
        return refused(exc)
    except PoolTimeout:
        return busy()


def build_server(caller_for: Callable[[Any], ToolCaller], *, default_scope: str, tools: list[ToolView]) -> Server[Any]:
    """``caller_for(ctx)``: the ToolCaller of the request's tenant (stdio: one; HTTP: the key's)."""
    listed = [_tool(v) for v in tools] + READ_TOOLS

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        meta = params.meta or {}
        scope = meta.get(SCOPE_META, default_scope)  # present but empty is refused, never replaced
        caller = caller_for(ctx)
        arguments = params.arguments or {}
        if params.name == "wait_operation":
            return await wait_for_outcome(caller, arguments)
        priority = meta.get(PRIORITY_META, 0)
        traceparent = meta.get(TRACEPARENT_META)
        return await anyio.to_thread.run_sync(
            dispatch, caller, params.name, arguments, str(scope), priority, traceparent
        )

    server: Server[Any] = Server(
        "agent-outbox",
        instructions=(
            "Each tool asks a business system for one effect, at most once: the same call again returns the "
            "same operation's outcome. Read `outcome` and `model_message`. Never retry UNKNOWN or PENDING "
            "operations: use wait_operation."
        ),
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )
    install(server, TasksExtension(caller_for, call_tool, task_tools=frozenset(v.action for v in tools)))
    return server


class BearerKeys:
    """ASGI middleware: every request carries an agent-outbox API key with scope ``submit``; the
    ToolCaller of its tenant rides in the ASGI scope for the handlers. A key that cannot be checked
    because the ledger did not answer is 503 with Retry-After (never 401: the key may be good)."""

    def __init__(self, app: ASGIApp, verify: Callable[[str], ToolCaller | None]) -> None:
        self.app, self.verify = app, verify

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets and anything else: not served
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope.get("path") == "/healthz":  # liveness, for compose and load balancers: no key needed
            await _answer(send, 200, {"status": "ok"})
            return
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        try:
            caller = await anyio.to_thread.run_sync(self.verify, token) if token else None
        except PoolTimeout:
            detail = (
                "every database connection of this server stayed in use and the key could not be checked; "
                "nothing was done: send the request again (or raise OUTBOX_API_DB_CONNECTIONS)"
            )
            await _answer(send, 503, {"error": "busy", "detail": detail}, [(b"retry-after", b"1")])
            return
        except OperationalError:
            detail = "the ledger's database did not answer and the key could not be checked; nothing was done"
            await _answer(send, 503, {"error": "unavailable", "detail": detail}, [(b"retry-after", b"5")])
            return
        if caller is None:
            detail = "send Authorization: Bearer <an API key with scope submit>"
            await _answer(send, 401, {"error": "unauthorized", "detail": detail}, [(b"www-authenticate", b"Bearer")])
            return
        scope[CALLER_KEY] = caller
        await self.app(scope, receive, send)


async def _answer(send: Send, status: int, body: dict[str, str], headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]}
    )
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def key_callers(outbox: Outbox, rules: ActionRules) -> Callable[[str], ToolCaller | None]:
    """For BearerKeys: an API key's ToolCaller (its tenant, the key as subject), or None when the key
    is unknown, revoked or lacks scope ``submit``. One ToolCaller per key, kept."""
    callers: dict[int, ToolCaller] = {}

    def by_key(token: str) -> ToolCaller | None:
        with outbox.sessions() as session:
            who = verify(session, token)
        if who is None or "submit" not in who.scopes:
            return None
        if who.key_id not in callers:  # per key: the key is who asks (and may not approve its own)
            callers[who.key_id] = ToolCaller(
                outbox, rules, tenant=who.tenant, subject=f"api:key-{who.key_id}", identity=who.identity
            )
        return callers[who.key_id]

    return by_key
