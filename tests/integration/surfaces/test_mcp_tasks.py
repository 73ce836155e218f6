"""MCP Tasks (issue 34, part 1) through the official SDK's client, over stdio and streamable HTTP: a
task-augmented tools/call is the operation; its task follows it through approval (input_required and
the console's URL), an unknown outcome and the provider lookup (working, saying which) to completed,
with exactly one effect at the sandbox; a business failure is completed with isError; another tenant
never sees the task. The SDK client has no task helpers: the spec's methods are sent as they are."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
import pytest

from tests.harness import action, actions_doc
from tests.integration.surfaces.test_api import _key
from tests.integration.surfaces.test_mcp import _http_server, _stdio

mcp = pytest.importorskip("mcp")
from mcp import Client  # noqa: E402
from mcp.shared.exceptions import MCPError  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR", "reason": "damaged"}
NOTE = "orders.note.create"
SCOPE = {"agent-outbox/scope": "conv-7"}


def _actions(pipe: Any, sandbox: Any) -> None:
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"description": "Refund an order.", "reference_args": ["order_id"]}
    refund["approval"] = {"required": "always", "ttl_s": 600}
    note = action("/v1/notes", args=["order_id", "text"])
    note["tool"] = {"description": "Note on an order.", "reference_args": ["order_id"], "destructive": False}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund, NOTE: note}))


def _approver(pipe: Any, tenant: str) -> Any:
    from outbox.actions.rules import load_action_rules
    from producer.agents.calls import ToolCaller
    from producer.client import Outbox

    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    return ToolCaller(Outbox(pipe.sessions.kw["bind"], rules=rules), rules, tenant=tenant, subject="console")


async def call_task(client: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The SDK client validates every tools/call answer as a CallToolResult, so a CreateTaskResult is
    sent and read on its raw request path (the JSON-RPC a client in any language sends)."""
    params = {"name": REFUND, "arguments": args, "task": {}, "_meta": SCOPE}
    raw = await client.session._dispatcher.send_raw_request("tools/call", params, {"timeout": 60})
    created = types.CreateTaskResult.model_validate(raw, by_name=False)
    return dict(created.task.model_dump(by_alias=True, mode="json")) | {"_meta": created.meta}


async def get_task(client: Any, task_id: str) -> dict[str, Any]:
    got = await client.session.send_request(
        types.GetTaskRequest(params=types.GetTaskRequestParams(task_id=task_id)), types.GetTaskResult
    )
    return dict(got.model_dump(by_alias=True, mode="json"))


async def task_result(client: Any, task_id: str) -> types.CallToolResult:
    request = types.GetTaskPayloadRequest(params=types.GetTaskPayloadRequestParams(task_id=task_id))
    return await client.session.send_request(request, types.CallToolResult, request_read_timeout_seconds=60)


async def list_tasks(client: Any) -> list[str]:
    listed = await client.session.send_request(types.ListTasksRequest(), types.ListTasksResult)
    return [t.task_id for t in listed.tasks]


async def until(client: Any, task_id: str, ok: Callable[[dict[str, Any]], bool], seen: list[str]) -> dict[str, Any]:
    for _ in range(300):
        task = await get_task(client, task_id)
        seen.append(f"{task['status']}: {task.get('statusMessage')}")
        if ok(task):
            return task
        await anyio.sleep(0.1)
    raise AssertionError(seen)


async def scenario(pipe: Any, sandbox: Any, tenant: str, a: Any, b: Any, elicited: list[Any]) -> None:
    """``a``, ``b``: async context managers of a client of tenant A (``tenant``) and of another tenant;
    ``elicited``: what A's elicitation callback received."""
    approver = _approver(pipe, tenant)
    async with a() as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        refund = tools[REFUND]
        assert refund.execution is not None and refund.execution.task_support == "optional"
        assert refund.annotations.destructive_hint and refund.annotations.idempotent_hint
        assert refund.annotations.open_world_hint and not refund.annotations.read_only_hint
        assert tools[NOTE].annotations.destructive_hint is False  # tool.destructive: false in the actions file
        assert tools[NOTE].annotations.idempotent_hint and tools[NOTE].execution.task_support == "optional"
        assert tools["get_operation"].annotations.read_only_hint is True
        assert tools["wait_operation"].annotations.read_only_hint is True

        # Returned once committed: the task is the operation, waiting for a person in the console.
        task = await call_task(client, ARGS)
        task_id = task["taskId"]
        assert pipe.op(task_id).status == "awaiting_approval"
        assert task["status"] == "working" and task["pollInterval"] == 1000  # a task begins working (spec)
        got = await get_task(client, task_id)
        assert got["status"] == "input_required" and "/console/approvals" in got["statusMessage"]
        elicitation = got["_meta"]["agent-outbox/elicitation"]
        assert elicitation["mode"] == "url" and elicitation["url"].endswith(f"/console/approvals#op-{task_id}")
        assert (await call_task(client, ARGS))["taskId"] == task_id  # the same call: the same task

        with pytest.raises(MCPError):  # taskSupport absent (forbidden): -32601
            await client.session._dispatcher.send_raw_request(
                "tools/call", {"name": "get_operation", "arguments": {"operation_id": task_id}, "task": {}}, {}
            )

        # On input_required the client calls tasks/result (spec): it blocks, and the URL-mode
        # elicitation of the console's page arrives tagged with the task.
        results: list[types.CallToolResult] = []

        async def fetch() -> None:
            results.append(await task_result(client, task_id))

        async with anyio.create_task_group() as tg:
            tg.start_soon(fetch)
            for _ in range(100):
                if elicited:
                    break
                await anyio.sleep(0.1)
            [asked] = elicited
            assert asked.mode == "url" and asked.url == elicitation["url"] and asked.elicitation_id == task_id
            assert asked.meta["io.modelcontextprotocol/related-task"] == {"taskId": task_id}

            # Approved, the provider commits and the answer is lost: working, "outcome unknown".
            sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", count=1)
            await anyio.to_thread.run_sync(lambda: approver.approve(task_id, by="alice"))
            seen: list[str] = []
            unknown = await until(client, task_id, lambda t: "outcome unknown" in (t.get("statusMessage") or ""), seen)
            assert unknown["status"] == "working"
            assert unknown["statusMessage"] == "outcome unknown: asking the provider"
            assert not any(s.startswith("completed") for s in seen) and not results
            # A cancel now is too late (it may have happened): best effort, the task goes on.
            late = await client.session.send_request(
                types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=task_id)), types.CancelTaskResult
            )
            assert late.status == "working" and late.status_message == "outcome unknown: asking the provider"

            # The reconciler asks the provider: completed; the blocked tasks/result answers then.
            await anyio.to_thread.run_sync(lambda: pipe.start_worker("reconciler", queues="outcome_unknown"))
        [result] = results
        assert not result.is_error and result.structured_content["outcome"] == "SUCCEEDED", result  # the late success
        assert (await get_task(client, task_id))["status"] == "completed"

        # A business failure (the provider refuses for good): completed, the result isError.
        await anyio.to_thread.run_sync(lambda: sandbox.configure(over_limit_amount="10.00"))
        failed_id = (await call_task(client, ARGS | {"order_id": "o-82"}))["taskId"]
        await anyio.to_thread.run_sync(lambda: approver.approve(failed_id, by="alice"))
        failed = await task_result(client, failed_id)
        assert failed.is_error and failed.structured_content["outcome"] == "FAILED_BEFORE_COMMIT"
        assert (await get_task(client, failed_id))["status"] == "completed"

        # Cancel before anything was sent: cancelled.
        cancel_id = (await call_task(client, ARGS | {"order_id": "o-83"}))["taskId"]
        cancelled = await client.session.send_request(
            types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=cancel_id)), types.CancelTaskResult
        )
        assert cancelled.status == "cancelled"
        with pytest.raises(MCPError, match="already in terminal status 'cancelled'"):  # spec: -32602
            await client.session.send_request(
                types.CancelTaskRequest(params=types.CancelTaskRequestParams(task_id=cancel_id)), types.CancelTaskResult
            )
        assert {task_id, failed_id, cancel_id} <= set(await list_tasks(client))

    async with a() as again:  # another server process (stdio) or connection: the task is the ledger row
        assert (await get_task(again, task_id))["status"] == "completed"
        assert not (await task_result(again, task_id)).is_error

    async with b() as other:  # the tenant wall
        with pytest.raises(MCPError):
            await get_task(other, task_id)
        with pytest.raises(MCPError):
            await task_result(other, task_id)
        assert task_id not in await list_tasks(other)
    assert pipe.op(task_id).tenant == tenant


def _record(elicited: list[Any]) -> Any:
    async def callback(context: Any, params: Any) -> types.ElicitResult:
        elicited.append(params)
        return types.ElicitResult(action="accept")  # "I opened it": the decision is the console's

    return callback


def _effects(sandbox: Any, tenant: str) -> None:
    assert len(sandbox.effects(key=f'{tenant}:conv-7:{REFUND}:ref="o-81"')) == 1
    assert len(sandbox.effects()) == 1  # the refused o-82 and the cancelled o-83 made none


def test_tasks_over_stdio(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker("sender", queues="dispatch")
    pipe.start_relay()

    elicited: list[Any] = []

    @asynccontextmanager
    async def client_of(tenant: str) -> AsyncIterator[Any]:
        async with Client(
            _stdio(pipe, "--tenant", tenant),
            read_timeout_seconds=60,
            mode="legacy",
            elicitation_callback=_record(elicited),
        ) as client:
            yield client

    pipe.env["OUTBOX_PUBLIC_URL"] = "https://outbox.example"  # where people open the console
    anyio.run(scenario, pipe, sandbox, "t1", lambda: client_of("t1"), lambda: client_of("t2"), elicited)
    assert elicited[0].url.startswith("https://outbox.example/console/approvals#op-")
    _effects(sandbox, "t1")


def test_tasks_over_streamable_http(pipe, sandbox):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    _actions(pipe, sandbox)
    pipe.start_worker("sender", queues="dispatch")
    pipe.start_relay()
    keys = {tenant: _key(pipe.env, tenant, "submit,read") for tenant in ("acme", "globex")}
    with _http_server(pipe) as url:
        elicited: list[Any] = []

        @asynccontextmanager
        async def client_of(tenant: str) -> AsyncIterator[Any]:
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
                transport = streamable_http_client(url, http_client=http)
                async with Client(transport, mode="legacy", elicitation_callback=_record(elicited)) as client:
                    yield client

        anyio.run(scenario, pipe, sandbox, "acme", lambda: client_of("acme"), lambda: client_of("globex"), elicited)
        assert elicited[0].url.startswith(url.removesuffix("mcp") + "console/approvals#op-")  # no OUTBOX_PUBLIC_URL
    _effects(sandbox, "acme")
