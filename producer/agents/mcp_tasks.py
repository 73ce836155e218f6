"""MCP Tasks (spec 2025-11-25) for the MCP server: a ``tools/call`` with ``task`` is answered with a
``CreateTaskResult`` once its intent is committed, then ``tasks/get``, ``tasks/result``, ``tasks/cancel``
and ``tasks/list``.

The task IS the operation: its ``taskId`` is the operation id and its state is the ledger row's, so a
task survives a server restart and every read is tenant-scoped (outbox.service.operations). Mapping:

    awaiting_approval                                   -> input_required (+ a URL-mode elicitation of
                                                           the console's approvals page: never a form)
    not_dispatched, dispatching, outcome_unknown,
    reconciliation_required, accepted                   -> working, statusMessage says which (queued and
                                                           not sent yet, in progress, accepted: the typed
                                                           outcome's stage)
    succeeded, committed_evidence_degraded              -> completed
    failed_before_commit, failed_at_provider            -> completed, result isError (a business outcome)
    cancelled                                           -> cancelled

The SDK ships no Tasks implementation: ``TasksExtension`` is an ``mcp.server.extension.Extension``
(its methods and a ``tools/call`` interceptor). Our server is the lowlevel ``Server``, so ``install``
applies it: the methods as request handlers, the interceptor as a server middleware for task-augmented
calls (a ``CreateTaskResult`` is not a ``CallToolResult``: the tools/call result sieve would refuse
it), and the ``tasks`` capability.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server
from mcp.server.extension import Extension, MethodBinding
from mcp.shared.message import ServerMessageMetadata
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from outbox.errors import OperationNotFound, OutboxError
from outbox.ledger.states import Status
from outbox.ledger.typed_outcome import Stage, stage_of
from outbox.service import operations, waiting
from outbox.settings import load_settings
from producer.agents.calls import ToolCaller

IDENTIFIER = "io.modelcontextprotocol/tasks"
RELATED_TASK = "io.modelcontextprotocol/related-task"
ELICITATION_META = "agent-outbox/elicitation"  # the URL-mode elicitation of an input_required task
POLL_MS = 1000
LIST_PAGE = 50

WORKING_MESSAGE: dict[Status, str] = {
    Status.NOT_DISPATCHED: "queued: not sent yet",
    Status.DISPATCHING: "sending to the provider",
    Status.OUTCOME_UNKNOWN: "outcome unknown: asking the provider",
    Status.RECONCILIATION_REQUIRED: "with a person: the outcome could not be established automatically",
    Status.ACCEPTED: "accepted by the provider: waiting for its final answer",
}
# Not dispatched after a try that left (a 503, a reset proven harmless): the typed outcome's IN_PROGRESS,
# never "queued: not sent yet" (outbox/ledger/typed_outcome.py stage_of).
RETRYING_MESSAGE = "in progress: tried, and tried again under the same key"
COMPLETED = frozenset({Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED})
FAILED = frozenset({Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER})
TERMINAL = frozenset({"completed", "failed", "cancelled"})


def _iso(value: dt.datetime | None) -> str:
    value = value or dt.datetime.now(dt.UTC)
    return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).isoformat()


def approval_url(base: str, operation_id: str) -> str:
    return f"{base.rstrip('/')}/console/approvals#op-{operation_id}"


def task_of(op: Any, base_url: str) -> dict[str, Any]:
    """The task of an operation row, as it is now (its wire form)."""
    status = Status(op.status)
    meta: dict[str, Any] | None = None
    if status is Status.AWAITING_APPROVAL:
        url = approval_url(base_url, op.id)
        state, message = "input_required", f"awaiting approval: a person approves it in the console: {url}"
        elicitation = types.ElicitRequestURLParams(
            message=f"Approve or deny {op.action} in the agent-outbox console.", url=url, elicitation_id=op.id
        )
        meta = {ELICITATION_META: elicitation.model_dump(by_alias=True, mode="json", exclude_none=True)}
    elif status in COMPLETED:
        state, message = "completed", "succeeded"
    elif status in FAILED:
        state, message = "completed", f"{status.value}: it did not happen (see the result)"
    elif status is Status.CANCELLED:
        state, message = "cancelled", "cancelled"
    elif status is Status.ABANDONED:
        state, message = "completed", "abandoned: a person stopped checking whether it happened (see the result)"
    elif status is Status.NOT_DISPATCHED and _stage(op) is Stage.IN_PROGRESS:
        state, message = "working", RETRYING_MESSAGE
    else:
        state, message = "working", WORKING_MESSAGE.get(status, status.value)
    task = types.Task(
        task_id=op.id,
        status=state,  # type: ignore[arg-type]
        status_message=message,
        created_at=_iso(op.created_at),
        last_updated_at=_iso(op.updated_at),
        ttl=None,  # the ledger's retention decides, not the task
        poll_interval=POLL_MS,
    )
    doc = task.model_dump(by_alias=True, mode="json", exclude_none=True)
    doc.setdefault("ttl", None)  # required on the wire (null: unlimited)
    if meta:
        doc["_meta"] = meta
    return doc


def _stage(op: Any) -> Stage | None:
    request = getattr(op, "request_digest", None) or getattr(op, "request_version", None)
    return stage_of({"status": op.status, "attempts": getattr(op, "attempt_count", 0), "request": request})


def _not_found(task_id: str) -> types.ErrorData:
    return types.ErrorData(code=types.INVALID_PARAMS, message=f"no task {task_id!r} for this tenant")


class TasksExtension(Extension):
    """Tasks over the ledger. ``caller_for(ctx)``: the request's tenant's ToolCaller (as build_server);
    ``base_url(ctx)``: where the console is (OUTBOX_PUBLIC_URL, else the HTTP request's own base)."""

    identifier = IDENTIFIER

    def __init__(
        self,
        caller_for: Callable[[Any], ToolCaller],
        call_tool: Callable[..., Any],
        *,
        task_tools: frozenset[str],
        base_url: Callable[[Any], str] | None = None,
    ) -> None:
        """``task_tools``: the tools with ``execution.taskSupport: optional`` (the actions)."""
        self.caller_for, self.call_tool, self.task_tools = caller_for, call_tool, task_tools
        self.base_url = base_url or default_base_url(load_settings().public_url)

    def settings(self) -> dict[str, Any]:
        return {}

    def methods(self) -> Sequence[MethodBinding]:
        return (
            MethodBinding("tasks/get", types.GetTaskRequestParams, self.get),
            MethodBinding("tasks/result", types.GetTaskPayloadRequestParams, self.result),
            MethodBinding("tasks/cancel", types.CancelTaskRequestParams, self.cancel),
            MethodBinding("tasks/list", types.PaginatedRequestParams, self.list),
        )

    async def intercept_tool_call(self, params: types.CallToolRequestParams, ctx: Any, call_next: Any) -> Any:
        """A task-augmented call: submitted as any call (the intent is committed when call_tool
        returns), answered with the operation as a task. Refused or read-only calls are answered as
        they are (a task needs an operation)."""
        if params.task is None:
            return await call_next(ctx)
        if params.name not in self.task_tools:  # taskSupport absent, i.e. forbidden (spec)
            return types.ErrorData(code=types.METHOD_NOT_FOUND, message=f"{params.name} cannot run as a task")
        result = await self.call_tool(ctx, params)
        structured = getattr(result, "structured_content", None) or {}
        if getattr(result, "is_error", False) or "operation_id" not in structured:
            return result  # refused input: nothing was submitted, so there is no task
        task = await self._task(ctx, structured["operation_id"])
        assert task is not None  # just committed, this tenant's
        if task["status"] == "input_required":  # a task begins working (spec); tasks/get then asks
            task["status"] = "working"
        created: dict[str, Any] = {"task": task}
        if "_meta" in task:  # the elicitation, where a client reads a result's _meta
            created["_meta"] = task["_meta"]
        return created

    async def _task(self, ctx: Any, operation_id: str) -> dict[str, Any] | None:
        caller, base = self.caller_for(ctx), self.base_url(ctx)

        def read() -> dict[str, Any] | None:
            with caller.outbox.sessions() as session:
                try:
                    return task_of(operations.get(session, caller.tenant, operation_id), base)
                except OperationNotFound:
                    return None

        return await anyio.to_thread.run_sync(read)

    async def get(self, ctx: Any, params: types.GetTaskRequestParams) -> Any:
        task = await self._task(ctx, params.task_id)
        return _not_found(params.task_id) if task is None else task

    async def result(self, ctx: Any, params: types.GetTaskPayloadRequestParams) -> Any:
        """Blocks until the task is terminal (spec), then the tool call's result: for a business failure
        a CallToolResult with isError true."""
        caller = self.caller_for(ctx)
        asked = False
        async with anyio.create_task_group() as elicitations:
            while True:
                task = await self._task(ctx, params.task_id)
                if task is None or task["status"] in TERMINAL:
                    break
                if task["status"] == "input_required" and not asked:
                    asked = True  # once per tasks/result: the person decides in the console, not here
                    elicitations.start_soon(self._elicit, ctx, task)
                # Waits on the event loop (no thread held) until the outcome moves; what the waiter
                # calls settled (a person needed) is not terminal for a task: then at most one read
                # per poll interval.
                started = anyio.current_time()
                if task["status"] == "working":
                    await waiting.wait_async(caller.outbox.sessions, params.task_id, timeout_s=waiting.MAX_WAIT_S)
                if anyio.current_time() - started < POLL_MS / 1000:
                    await anyio.sleep(POLL_MS / 1000)
            elicitations.cancel_scope.cancel()
        if task is None:
            return _not_found(params.task_id)
        answer = await anyio.to_thread.run_sync(caller.get, params.task_id)
        done = types.CallToolResult(
            content=[types.TextContent(text=answer.model_message)],
            structured_content=answer.as_dict(),
            is_error=Status(answer.status) in FAILED,  # a business outcome, not a protocol failure
        )
        doc = done.model_dump(by_alias=True, mode="json", exclude_none=True)
        doc["_meta"] = {**doc.get("_meta", {}), RELATED_TASK: {"taskId": params.task_id}}
        return doc

    async def _elicit(self, ctx: Any, task: dict[str, Any]) -> None:
        """The URL-mode elicitation of an input_required task, on the tasks/result request's stream
        and tagged with the task (spec: input_required). Best effort: a client without URL-mode
        elicitation still has the URL in tasks/get; its answer decides nothing (the console does)."""
        url_mode = types.ClientCapabilities(
            elicitation=types.ElicitationCapability(url=types.UrlElicitationCapability())
        )
        session = getattr(ctx, "session", None)
        if session is None or not session.check_client_capability(url_mode):
            return
        elicitation = dict(task["_meta"][ELICITATION_META])
        elicitation["_meta"] = {RELATED_TASK: {"taskId": task["taskId"]}}
        request = types.ElicitRequest(params=types.ElicitRequestURLParams.model_validate(elicitation, by_name=False))
        try:
            await session.send_request(
                request, types.ElicitResult, metadata=ServerMessageMetadata(related_request_id=ctx.request_id)
            )
        except Exception:  # noqa: BLE001 (no back channel, a declined or failed elicitation: the URL stays in tasks/get)
            return

    async def cancel(self, ctx: Any, params: types.CancelTaskRequestParams) -> Any:
        """Best effort (outbox.service.operations.cancel): cancelled if nothing was sent yet, else the
        operation ends as what really happened, and the task says so (a late success is completed)."""
        caller = self.caller_for(ctx)
        before = await self._task(ctx, params.task_id)
        if before is None:
            return _not_found(params.task_id)
        if before["status"] in TERMINAL:  # spec: -32602 for a task already terminal
            return types.ErrorData(
                code=types.INVALID_PARAMS,
                message=f"Cannot cancel task: already in terminal status {before['status']!r}",
            )

        def request() -> bool:
            with caller.outbox.sessions.begin() as session:
                try:
                    operations.cancel(
                        session, caller.tenant, params.task_id, actor=f"mcp:{caller.subject}", reason="tasks/cancel"
                    )
                except OperationNotFound:
                    return False
                except OutboxError:
                    pass  # already final: the task answers what happened
            return True

        if not await anyio.to_thread.run_sync(request):
            return _not_found(params.task_id)
        task = await self._task(ctx, params.task_id)
        return _not_found(params.task_id) if task is None else task

    async def list(self, ctx: Any, params: types.PaginatedRequestParams) -> Any:
        caller, base = self.caller_for(ctx), self.base_url(ctx)

        def read() -> dict[str, Any]:
            with caller.outbox.sessions() as session:
                found = operations.page(session, caller.tenant, cursor=params.cursor, limit=LIST_PAGE)
                doc: dict[str, Any] = {"tasks": [task_of(op, base) for op in found.operations]}
            if found.next_cursor:
                doc["nextCursor"] = found.next_cursor
            return doc

        try:
            return await anyio.to_thread.run_sync(read)
        except OutboxError as exc:
            return types.ErrorData(code=types.INVALID_PARAMS, message=str(exc))


def default_base_url(public_url: str) -> Callable[[Any], str]:
    """OUTBOX_PUBLIC_URL (outbox.settings), else the HTTP request's own base URL (stdio: localhost)."""

    def base_url(ctx: Any) -> str:
        if public_url:
            return public_url
        base = getattr(getattr(ctx, "request", None), "base_url", None)
        return str(base) if base else "http://localhost:8000"

    return base_url


def capability() -> types.ServerTasksCapability:
    return types.ServerTasksCapability(
        list=types.TasksListCapability(),
        cancel=types.TasksCancelCapability(),
        requests=types.ServerTasksRequestsCapability(
            tools=types.TasksToolsCapability(call=types.TasksCallCapability())
        ),
    )


def install(server: Server[Any], extension: TasksExtension) -> None:
    """Apply the extension to a lowlevel Server: its methods, its interceptor (for task-augmented
    tools/call only) and the ``tasks`` capability."""
    for binding in extension.methods():
        server.add_request_handler(binding.method, binding.params_type, binding.handler)

    async def tasks_middleware(ctx: Any, call_next: Any) -> Any:
        if ctx.method != "tools/call" or not isinstance(ctx.params, dict) or ctx.params.get("task") is None:
            return await call_next(ctx)
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:  # 2026-07-28: Tasks left the core spec
            return await call_next(ctx)  # (SEP-2663's other shape); served as a normal call
        params = types.CallToolRequestParams.model_validate(ctx.params, by_name=False)
        return await extension.intercept_tool_call(params, ctx, call_next)

    server.middleware.append(tasks_middleware)
    plain = server.get_capabilities

    def with_tasks(*args: Any, **kwargs: Any) -> types.ServerCapabilities:
        return plain(*args, **kwargs).model_copy(update={"tasks": capability()})

    server.get_capabilities = with_tasks  # type: ignore[method-assign]
