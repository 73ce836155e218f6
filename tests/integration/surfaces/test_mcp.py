"""The MCP server (issue 19) through the official SDK's client, over stdio and over streamable HTTP:
a real ``agent-outbox mcp`` process, workers, relay, PostgreSQL, Redis and the sandbox, which counts
every effect."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import text

from tests import spawn
from tests.harness import action, actions_doc, database_sessions, wait_for
from tests.integration.surfaces.test_api import _key

mcp = pytest.importorskip("mcp")
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[3]
REFUND = "payments.refund.create"
ARGS = {"order_id": "o-81", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _actions(pipe: Any, sandbox: Any) -> None:
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"description": "Refund an order.", "reference_args": ["order_id"]}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))


def _stdio(pipe: Any, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "workers.cli.main", "mcp", "--tenant", "t1", *extra],
        env=dict(os.environ) | pipe.env,
        cwd=str(ROOT),
    )


async def _call(client: Any, name: str, args: dict[str, Any], scope: str = "conv-1") -> Any:
    return await client.call_tool(name, args, meta={"agent-outbox/scope": scope})


def test_stdio_tools_listed_called_once_and_answered_already_done_then_unknown_settles(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker("sender", queues="dispatch")  # the reconciler starts later: UNKNOWN stays visible
    pipe.start_relay()

    async def session() -> None:
        async with Client(_stdio(pipe), read_timeout_seconds=30) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == {REFUND, "get_operation", "wait_operation"}
            refund = tools[REFUND]
            assert refund.annotations.idempotent_hint is True and refund.annotations.destructive_hint is True
            assert refund.annotations.open_world_hint is True and "order_id" in refund.input_schema["properties"]

            first = await _call(client, REFUND, ARGS)
            assert not first.is_error, first.content
            op = first.structured_content
            assert op["outcome"] == "PENDING" and op["new"] is True
            assert op["idempotency_key"] == f'conv-1:{REFUND}:ref="o-81"'
            assert first.content[0].text == op["model_message"]
            done = await _call(client, "wait_operation", {"operation_id": op["operation_id"], "timeout_s": 20})
            assert done.structured_content["outcome"] == "SUCCEEDED", done.structured_content
            # The model calls it again (a retry, another wording of the reason): the same operation.
            again = await _call(client, REFUND, ARGS | {"reason": "damaged in transit"})
            assert (
                again.structured_content["operation_id"] == op["operation_id"]
                and again.structured_content["new"] is False
            )
            assert "Already done" in again.content[0].text and "do not retry" in again.content[0].text
            assert (
                again.structured_content["conflict"] is True
                and "already made with other arguments" in again.content[0].text
            )
            same = await _call(client, REFUND, ARGS)  # the very same call: the same, no conflict
            assert (
                same.structured_content["operation_id"] == op["operation_id"]
                and not same.structured_content["conflict"]
            )

            # An ambiguous answer: UNKNOWN with its message, then settled by the reconciler.
            sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", count=1)
            lost = await _call(client, REFUND, ARGS | {"order_id": "o-82"})
            unknown = await _call(client, "get_operation", {"operation_id": lost.structured_content["operation_id"]})
            for _ in range(100):
                if unknown.structured_content["outcome"] != "PENDING":
                    break
                await anyio.sleep(0.1)
                unknown = await _call(
                    client, "get_operation", {"operation_id": lost.structured_content["operation_id"]}
                )
            assert unknown.structured_content["outcome"] == "UNKNOWN", unknown.structured_content
            assert "do not retry" in unknown.content[0].text
            await anyio.to_thread.run_sync(lambda: pipe.start_worker("reconciler", queues="outcome_unknown"))
            settled = await _call(
                client, "wait_operation", {"operation_id": lost.structured_content["operation_id"], "timeout_s": 30}
            )
            assert settled.structured_content["outcome"] == "SUCCEEDED", settled.structured_content

            # The host's priority travels in _meta (a tool's own "priority" argument is business data):
            # not part of the call's identity, and refused out of range.
            meta = {"agent-outbox/scope": "conv-1", "agent-outbox/priority": 9}
            urgent = await client.call_tool(REFUND, ARGS, meta=meta)
            assert urgent.structured_content["operation_id"] == op["operation_id"]
            meta["agent-outbox/priority"] = 101
            refused = await client.call_tool(REFUND, ARGS | {"order_id": "o-84"}, meta=meta)
            assert refused.is_error and "priority must be an integer from -100 to 100" in refused.content[0].text

            bad = await _call(client, REFUND, {"amount": "1.00", "currency": "EUR"})
            assert bad.is_error and "args.order_id" in bad.content[0].text

            # The host's trace travels in _meta too (W3C traceparent): stored with the intent, so its
            # spans continue the host's trace; a malformed one is refused, naming it.
            meta = {"agent-outbox/scope": "conv-1", "traceparent": TRACEPARENT}
            traced = await client.call_tool(REFUND, ARGS | {"order_id": "o-85"}, meta=meta)
            assert pipe.op(traced.structured_content["operation_id"]).traceparent == TRACEPARENT
            meta["traceparent"] = "00-not-a-trace"
            untraceable = await client.call_tool(REFUND, ARGS | {"order_id": "o-86"}, meta=meta)
            assert untraceable.is_error and "traceparent must be W3C trace context" in untraceable.content[0].text

    anyio.run(session)
    assert len(sandbox.effects(key="t1:" + f'conv-1:{REFUND}:ref="o-81"')) == 1
    assert len(sandbox.effects(key="t1:" + f'conv-1:{REFUND}:ref="o-82"')) == 1
    wait_for(lambda: len(sandbox.effects()) == 3, 20, what="the traced call's effect")
    assert len(sandbox.effects(key="t1:" + f'conv-1:{REFUND}:ref="o-85"')) == 1


@contextmanager
def _http_server(pipe: Any) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(pipe.tmp / "mcp-http.log", "wb")
    proc = spawn.popen(
        [sys.executable, "-m", "workers.cli.main", "mcp", "--http", "--port", str(port)],
        cwd=ROOT,
        env=dict(os.environ) | pipe.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/mcp"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError((pipe.tmp / "mcp-http.log").read_text())
        try:
            return httpx.post(url, timeout=1).status_code == 401  # no key: refused, so it is up
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 30, what="mcp http server up")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_http_with_an_api_key_is_that_keys_tenant_and_one_effect(pipe, sandbox):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    _actions(pipe, sandbox)
    pipe.start_worker()
    pipe.start_relay()
    key = _key(pipe.env, "acme", "submit,read")
    with _http_server(pipe) as url:

        async def session() -> dict[str, Any]:
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
                async with Client(streamable_http_client(url, http_client=http)) as client:
                    assert REFUND in {t.name for t in (await client.list_tools()).tools}
                    first = await _call(client, REFUND, ARGS, scope="chat-9")
                    second = await _call(client, REFUND, ARGS, scope="chat-9")
                    assert first.structured_content["operation_id"] == second.structured_content["operation_id"]
                    waited = await _call(
                        client,
                        "wait_operation",
                        {"operation_id": first.structured_content["operation_id"], "timeout_s": 20},
                    )
                    return dict(waited.structured_content)

        done = anyio.run(session)
        assert done["outcome"] == "SUCCEEDED", done
        assert httpx.post(url, headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
        assert httpx.get(url.removesuffix("/mcp") + "/healthz", timeout=5).status_code == 200
    assert len(sandbox.effects(key=f'acme:chat-9:{REFUND}:ref="o-81"')) == 1
    assert len(sandbox.effects()) == 1


def test_a_call_rejected_for_good_is_tried_again_only_with_retry_of_and_once(pipe, sandbox):
    """After a final business rejection (a limit, later raised) the same call answers "not executed"
    forever; the model tries again by naming the failed operation (``retry_of``), which is a new key
    that cannot collide with the old record, and a repeat of the retry is the same operation."""
    _actions(pipe, sandbox)
    pipe.start_worker()
    pipe.start_relay()
    sandbox.configure(over_limit_amount="10.00")  # 12.50 is refused with 402 (stored, final)

    async def session() -> None:
        async with Client(_stdio(pipe), read_timeout_seconds=30) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "retry_of" in tools[REFUND].input_schema["properties"]
            first = await _call(client, REFUND, ARGS)
            failed_id = first.structured_content["operation_id"]
            failed = await _call(client, "wait_operation", {"operation_id": failed_id, "timeout_s": 20})
            assert failed.structured_content["outcome"] == "FAILED_BEFORE_COMMIT", failed.structured_content
            assert f'retry_of="{failed_id}"' in failed.content[0].text  # the model is told exactly how
            again = await _call(client, REFUND, ARGS)  # without retry_of: the same answer, nothing sent
            assert again.structured_content["operation_id"] == failed_id

            await anyio.to_thread.run_sync(lambda: sandbox.configure(over_limit_amount="10000.00"))  # fixed
            retried = await _call(client, REFUND, ARGS | {"retry_of": failed_id})
            assert not retried.is_error, retried.content
            new_id = retried.structured_content["operation_id"]
            assert new_id != failed_id and retried.structured_content["new"] is True
            assert retried.structured_content["idempotency_key"].endswith(f":retry-of={failed_id}")
            done = await _call(client, "wait_operation", {"operation_id": new_id, "timeout_s": 20})
            assert done.structured_content["outcome"] == "SUCCEEDED", done.structured_content
            # The model repeats its retry: the same operation, no second effect.
            repeat = await _call(client, REFUND, ARGS | {"retry_of": failed_id})
            assert repeat.structured_content["operation_id"] == new_id and "Already done" in repeat.content[0].text
            # retry_of cannot mint a new key for a call that succeeded, nor for another object's call.
            refused = await _call(client, REFUND, ARGS | {"retry_of": new_id})
            assert refused.is_error and "retry_of" in refused.content[0].text
            other = await _call(client, REFUND, ARGS | {"order_id": "o-99", "retry_of": failed_id})
            assert other.is_error and "another call" in other.content[0].text
            elsewhere = await _call(client, REFUND, ARGS | {"retry_of": failed_id}, scope="conv-2")
            assert elsewhere.is_error and "another call" in elsewhere.content[0].text

    anyio.run(session)
    ours = [e for e in sandbox.effects() if e["idempotency_key"].startswith(f't1:conv-1:{REFUND}:ref="o-81"')]
    assert len(ours) == 1 and len(sandbox.effects()) == 1  # the rejection made none, the retry exactly one


def test_a_conversations_budget_over_mcp_refused_with_what_is_left_and_nothing_sent(pipe, sandbox):
    """Issue 34: the MCP scope is the budget scope; a refusal is an error result whose structured
    content (valid against the tool's output schema, checked by the SDK's client) is REFUSED."""
    refund = action("/v1/refunds", decimal_args=["amount"], args=["order_id", "amount", "currency", "reason"])
    refund["tool"] = {"reference_args": ["order_id"]}
    refund["budget_scope"] = {"max_calls": 1}
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    pipe.start_worker()
    pipe.start_relay()

    async def session() -> None:
        async with Client(_stdio(pipe), read_timeout_seconds=30) as client:
            first = await _call(client, REFUND, ARGS)
            assert not first.is_error and first.structured_content["budget"]["left"].startswith("0 of 1 calls")
            refused = await _call(client, REFUND, ARGS | {"order_id": "o-82"})
            assert refused.is_error and refused.structured_content["outcome"] == "REFUSED"
            assert refused.structured_content["operation_id"] is None
            assert "its 1 calls are used" in refused.content[0].text
            elsewhere = await _call(client, REFUND, ARGS | {"order_id": "o-82"}, scope="conv-2")
            assert not elsewhere.is_error
            for answer in (first, elsewhere):
                op_id = answer.structured_content["operation_id"]
                done = await _call(client, "wait_operation", {"operation_id": op_id, "timeout_s": 20})
                assert done.structured_content["outcome"] == "SUCCEEDED", done.structured_content

    anyio.run(session)
    assert len(sandbox.effects()) == 2  # the refused call made none


def test_http_serves_eight_sessions_at_once_on_database_connections_opened_once(pipe, sandbox):
    """``mcp --http`` keeps its database connections as the HTTP API does (OUTBOX_API_DB_CONNECTIONS):
    eight agents calling tools at once are served on connections opened once. With SQLAlchemy's
    default pool (five kept, the rest closed on their return) the same calls opened dozens of
    PostgreSQL sessions, each a new backend and a new connect."""
    import time

    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    _actions(pipe, sandbox)
    key = _key(pipe.env, "acme", "submit,read")
    database = pipe.env["OUTBOX_DATABASE_URL"]
    with _http_server(pipe) as url:

        async def agent(k: int) -> None:
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
                async with Client(streamable_http_client(url, http_client=http)) as client:
                    for i in range(25):
                        called = await _call(client, REFUND, ARGS | {"order_id": f"o-{k}-{i}"}, scope=f"chat-{k}")
                        assert not called.is_error, called.content

        async def agents() -> None:
            async with anyio.create_task_group() as group:
                for k in range(8):
                    group.start_soon(agent, k)

        time.sleep(1.1)  # the server's start-up connections counted (a backend counts at its first transaction)
        before = database_sessions(database)
        anyio.run(agents)
        time.sleep(1.1)
        opened = database_sessions(database) - before
    with pipe.sessions() as s:
        stored = s.execute(text("SELECT count(*) FROM outbox_operations WHERE tenant = 'acme'")).scalar_one()
    assert stored == 200
    assert opened <= 12, opened  # at most about one per agent at once; the default pool opened dozens


def _keyed_post(app: Any, key: str) -> httpx.Response:
    """One POST /mcp with ``key`` through ``app`` in-process (its ASGI, no server)."""

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mcp") as client:
            return await client.post("/mcp", headers={"Authorization": f"Bearer {key}"})

    return anyio.run(post)


def test_a_key_that_cannot_be_checked_for_want_of_a_connection_is_503_busy_then_served(pipe, sandbox):
    """``mcp --http`` checks every request's key in the ledger (key_callers, as the CLI wires it).
    With every database connection of the server in use for the pool's whole wait the answer is 503
    busy with Retry-After, not a 500 (the pool's TimeoutError escaped the key check) nor a 401 (the
    key may be good); with a connection free again the same key passes as its tenant."""
    from outbox.actions.rules import load_action_rules
    from outbox.ledger.db import kept_pool_args, make_engine
    from producer.agents.mcp_server import CALLER_KEY, BearerKeys, key_callers
    from producer.client import Outbox

    _actions(pipe, sandbox)
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    key = _key(pipe.env, "acme", "submit")
    url = pipe.env["OUTBOX_DATABASE_URL"]
    engine = make_engine(url, **kept_pool_args(url, 1, 0.3))  # one connection, a short wait
    tenants: list[str] = []

    async def tools(scope: Any, receive: Any, send: Any) -> None:  # stands in for the MCP app behind
        tenants.append(scope[CALLER_KEY].tenant)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = BearerKeys(tools, key_callers(Outbox(engine, rules=rules), rules))
    try:
        held = engine.connect()  # the process's only connection
        try:
            busy = _keyed_post(app, key)
        finally:
            held.close()
        served = _keyed_post(app, key)
    finally:
        engine.dispose()
    assert busy.status_code == 503, busy.text
    assert busy.headers["retry-after"] == "1" and busy.json()["error"] == "busy", busy.text
    assert served.status_code == 204 and tenants == ["acme"], served.text


def test_a_key_that_cannot_be_checked_with_the_ledger_down_is_503_unavailable(pipe, sandbox):
    """The ledger's database unreachable (nothing listens on its port): 503 unavailable with
    Retry-After, not a 500 and not a 401."""
    from outbox.actions.rules import load_action_rules
    from outbox.ledger.db import make_engine
    from producer.agents.mcp_server import BearerKeys, key_callers
    from producer.client import Outbox

    _actions(pipe, sandbox)
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/test")

    async def tools(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("reached the tools without a checked key")

    try:
        down = _keyed_post(BearerKeys(tools, key_callers(Outbox(engine, rules=rules), rules)), "ao_" + "x" * 40)
    finally:
        engine.dispose()
    assert down.status_code == 503, down.text
    assert down.headers["retry-after"] == "5" and down.json()["error"] == "unavailable", down.text


def test_a_call_that_finds_every_connection_busy_is_a_busy_result_and_the_same_call_again_is_made_once(pipe, sandbox):
    """A server whose OUTBOX_API_DB_CONNECTIONS all stay in use for the pool's wait answers the tool
    call "Busy", an error result that says to call again (it was an unhandled exception). Called again
    once a connection is free, the call is made, and a third time it is found under its key."""
    from outbox.actions.rules import load_action_rules
    from outbox.ledger.db import kept_pool_args, make_engine
    from producer.agents.calls import ToolCaller
    from producer.agents.mcp_server import dispatch
    from producer.client import Outbox

    _actions(pipe, sandbox)
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    url = pipe.env["OUTBOX_DATABASE_URL"]
    engine = make_engine(url, **kept_pool_args(url, 1, 0.3))  # one connection, a short wait
    caller = ToolCaller(Outbox(engine, rules=rules), rules, tenant="t1", subject="agent:x")
    try:
        held = engine.connect()  # the process's only connection
        try:
            busy = dispatch(caller, REFUND, ARGS, "chat-1")
        finally:
            held.close()
        assert busy.is_error and busy.content[0].text.startswith("Busy"), busy.content
        with pipe.sessions() as s:
            assert s.execute(text("SELECT count(*) FROM outbox_operations")).scalar_one() == 0
        made = dispatch(caller, REFUND, ARGS, "chat-1")
        again = dispatch(caller, REFUND, ARGS, "chat-1")
    finally:
        engine.dispose()
    assert not made.is_error and made.structured_content["new"] is True, made.content
    assert again.structured_content["operation_id"] == made.structured_content["operation_id"]
    assert again.structured_content["new"] is False
