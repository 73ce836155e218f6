"""The typed HTTP client (producer/remote/) against a real ``agent-outbox serve`` over PostgreSQL, with
real workers, relay, Redis and the sandbox, which counts the effects. One server for the module.

A lost answer is lost for real: a TCP proxy in front of the server forwards the request and closes
the connection when the server's answer comes, before a byte of it reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest

from outbox.access.keys import create_key
from outbox.errors import OutboxError
from outbox.ledger.db import make_engine, make_sessionmaker
from producer.remote import (
    AsyncOutboxClient,
    Forbidden,
    IdempotencyConflict,
    InvalidInput,
    NotConfigured,
    NotFound,
    OutboxClient,
    OutboxProblem,
    OutboxUnreachable,
    RateLimited,
    RetryPolicy,
    RunConflict,
    SeparationOfDuties,
    Unauthorized,
    Unavailable,
)
from producer.remote.problems import PROBLEM_BASE, problem_of
from producer.remote.retries import retry_after_s
from tests.conftest import scratch_pg_database
from tests.harness import REFUND_ARGS, ROOT, action, actions_doc, pipeline, wait_for
from tests.integration.surfaces.test_api import _serve

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
REFUND = "payments.refund.create"
TICKET = "support.ticket.create"
BIG = dict(REFUND_ARGS, amount="900.00")  # over the approval threshold below


def _ticket(subject: str) -> dict[str, str]:
    return {"subject": subject, "customer_id": "cus-1"}


@dataclass
class Served:
    url: str
    pipe: Any
    sandbox: Any
    keys: dict[str, str]

    def client(self, who: str = "agent", **kw: Any) -> OutboxClient:
        return OutboxClient(self.url, self.keys[who], **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_url: str, sandbox_server: Any) -> Iterator[Served]:
    refund = action(
        "/v1/refunds",
        decimal_args=["amount"],
        approval={"required": "when", "when": "amount > 500", "ttl_s": 600, "separate_approver": True},
    )
    tmp = tmp_path_factory.mktemp("client")
    sandbox_server.reset()
    with scratch_pg_database(f"outbox_test_client_{uuid.uuid4().hex[:10]}") as url:
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        # One failed lookup is enough to hand an unknown outcome to a person (the handoff below).
        env = {"OUTBOX_RECONCILE_MAX_LOOKUPS": "1"}
        with pipeline(
            db_url=url, sessions=sessions, redis_url=redis_url, tmp=tmp, sandbox_url=sandbox_server.url, env=env
        ) as pipe:
            pipe.write_actions(actions_doc(sandbox_server.url, actions={REFUND: refund, TICKET: action("/v1/tickets")}))
            scopes = {
                "agent": ["submit", "read"],
                "both": ["submit", "read", "approve"],  # may approve, but not what it submitted itself
                "operator": ["read", "approve", "operate"],
                "reader": ["read"],
                "greedy": ["read"],
                # Used once, by the lost cancel below: its answer must be the server's act, never a
                # 429 of a bucket (10/s, bursts of 20) the agent key's earlier requests emptied.
                "canceller": ["submit", "read"],
            }
            keys = {}
            with sessions.begin() as session:
                for who, granted in scopes.items():
                    keys[who], _ = create_key(session, tenant="acme", scopes=granted, name=who)
            pipe.start_worker()
            pipe.start_relay()
            with _serve(pipe, OUTBOX_API_RATE_PER_S="10") as api:
                yield Served(api.url, pipe, sandbox_server, keys)
        engine.dispose()


def _effects(served: Served, key: str) -> int:
    return len(served.sandbox.effects(key=f"acme:{key}"))


def test_submit_wait_and_replay_make_one_effect(served):
    with served.client() as outbox:
        op = outbox.submit(REFUND, dict(REFUND_ARGS, amount=Decimal("12.50")), idempotency_key="cl-1")
        assert op.new is True and op.outcome == "PENDING" and op.idempotency_key == "cl-1" and op.tenant == "acme"
        done = outbox.wait(op.operation_id, timeout_s=30)
        assert done.settled and done.outcome == "SUCCEEDED" and done.reference, done
        assert done.model_message.startswith("Done:") and done.attempt_log  # its own result: never "Already done"
        # The same intent again (12.5 is 12.50 by value): the same operation, nothing stored or sent anew.
        again = outbox.submit(REFUND, dict(REFUND_ARGS, amount=Decimal("12.5")), idempotency_key="cl-1")
        assert again.new is False and again.operation_id == op.operation_id and again.outcome == "SUCCEEDED"
        assert outbox.get(op.operation_id).history
        assert [o.operation_id for o in outbox.iter_operations(idempotency_key="cl-1")] == [op.operation_id]
    assert _effects(served, "cl-1") == 1


def test_refusals_are_typed_problems_with_their_fields(served):
    with served.client() as outbox:
        first = outbox.submit(TICKET, _ticket("printer on fire"), idempotency_key="cl-conflict")
        with pytest.raises(IdempotencyConflict) as conflict:
            outbox.submit(TICKET, _ticket("printer fine"), idempotency_key="cl-conflict")
        exc = conflict.value
        assert (exc.status, exc.kind, exc.title, exc.field) == (
            409,
            "idempotency-conflict",
            "Idempotency conflict",
            "idempotency_key",
        )
        assert exc.type == PROBLEM_BASE + "idempotency-conflict" and first.operation_id in exc.detail
        assert (exc.idempotency_key, exc.operation_id) == ("cl-conflict", first.operation_id)
        assert isinstance(exc, OutboxProblem) and isinstance(exc, OutboxError)

        for call, field in (
            (lambda: outbox.submit(TICKET, _ticket("x"), idempotency_key="cl-bad", max_attempts=0), "max_attempts"),
            (lambda: outbox.submit("no.such.action", {}, idempotency_key="cl-bad"), "action"),
            (lambda: outbox.submit(TICKET, _ticket("x"), idempotency_key=" cl-bad"), "idempotency_key"),
        ):
            with pytest.raises(InvalidInput) as bad:
                call()
            assert (bad.value.status, bad.value.field, bad.value.kind) == (422, field, "invalid"), bad.value
        # A binary float is refused before anything is sent, as producer.submit refuses it.
        with pytest.raises(InvalidInput) as floated:
            outbox.submit(REFUND, dict(REFUND_ARGS, amount=12.5), idempotency_key="cl-float")
        assert floated.value.field == "args.amount" and "Decimal" in floated.value.detail
        assert outbox.operations(idempotency_key="cl-float").operations == []

        with pytest.raises(NotFound) as missing:
            outbox.get("no-such-operation")
        assert missing.value.status == 404
    with OutboxClient(served.url, "ao_not-a-key") as stranger, pytest.raises(Unauthorized):
        stranger.get(first.operation_id)
    with served.client("reader") as reader, pytest.raises(Forbidden) as forbidden:
        reader.submit(TICKET, _ticket("x"), idempotency_key="cl-reader")
    assert forbidden.value.status == 403 and "submit" in forbidden.value.detail


def test_batch_answers_item_by_item(served):
    with served.client() as outbox:
        outbox.submit(TICKET, _ticket("one"), idempotency_key="cl-b0")
        items = outbox.submit_batch(
            [
                {"action": TICKET, "args": _ticket("two"), "idempotency_key": "cl-b1"},
                {"action": TICKET, "args": _ticket("changed"), "idempotency_key": "cl-b0"},
                {"action": TICKET, "idempotency_key": "cl-b2"},
            ]
        )
        assert [(i.index, i.status, i.ok) for i in items] == [(0, 201, True), (1, 409, False), (2, 422, False)]
        assert items[0].operation is not None and items[0].operation.idempotency_key == "cl-b1"
        assert items[1].problem and items[1].problem["operation_id"] and items[2].problem
        assert items[2].problem["field"] == "intents.2.args"


class DroppingProxy:
    """TCP in front of the API: forwards every request; the first ``drop`` answers never reach the
    client (its connection is closed as the server's answer arrives: the server has acted)."""

    def __init__(self, upstream: str, drop: int) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.drop, self.dropped = drop, 0
        self.seen = b""  # every request byte the client sent
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.sockets += [client, server]
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._answers, args=(server, client), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                with self.lock:
                    self.seen += data
                server.sendall(data)
        except OSError:
            pass

    def _answers(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while data := server.recv(65536):
                with self.lock:
                    lose = self.dropped < self.drop
                    self.dropped += lose
                if lose:
                    break
                client.sendall(data)
        except OSError:
            pass
        for s in (client, server):
            _hang_up(s)

    def close(self) -> None:
        with self.lock:
            for s in self.sockets:
                _hang_up(s)


def _hang_up(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv() on it; the peer reads the end
    except OSError:
        pass
    s.close()


def test_a_lost_answer_is_asked_again_with_the_same_key_and_stores_one_operation(served):
    proxy = DroppingProxy(served.url, drop=1)
    try:
        with OutboxClient(proxy.url, served.keys["agent"]) as outbox:
            op = outbox.submit(REFUND, REFUND_ARGS, idempotency_key="cl-lost")
        # The first answer (201) was lost after the server stored the intent; the retry found it.
        assert proxy.dropped >= 1 and op.new is False
        bodies = proxy.seen.decode().split("POST /v1/intents HTTP/1.1")[1:]
        assert len(bodies) == 2 and all('"idempotency_key":"cl-lost"' in b for b in bodies)
    finally:
        proxy.close()
    with served.client() as outbox:
        assert [o.operation_id for o in outbox.iter_operations(idempotency_key="cl-lost")] == [op.operation_id]
        assert outbox.wait(op.operation_id, timeout_s=30).outcome == "SUCCEEDED"
    assert _effects(served, "cl-lost") == 1

    # A decision is not replay-safe: its lost answer is the caller's to look into, never sent twice.
    with served.client() as outbox:
        big = outbox.submit(REFUND, BIG, idempotency_key="cl-lost-cancel")
    proxy = DroppingProxy(served.url, drop=1)
    try:
        with OutboxClient(proxy.url, served.keys["canceller"]) as outbox, pytest.raises(OutboxUnreachable) as lost:
            outbox.cancel(big.operation_id)
        assert lost.value.reached_server and proxy.seen.decode().count("POST /v1/operations/") == 1
    finally:
        proxy.close()
    with served.client() as outbox:
        assert outbox.get(big.operation_id).outcome == "CANCELLED"


def test_a_refused_connection_is_retried_then_said():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    policy = RetryPolicy(attempts=3, base_delay_s=0.01, max_delay_s=0.02)
    with OutboxClient(dead, "k", retry=policy) as outbox, pytest.raises(OutboxUnreachable) as down:
        outbox.submit(TICKET, _ticket("x"), idempotency_key="cl-down")
    assert not down.value.reached_server and down.value.idempotency_key == "cl-down"


def test_rate_limited_requests_wait_for_retry_after(served, caplog):
    caplog.set_level(logging.INFO, logger="producer.remote")

    def waits() -> list[float]:
        said = (re.search(r"retrying in ([\d.]+) s .*429", r.getMessage()) for r in caplog.records)
        return [float(m.group(1)) for m in said if m]

    with served.client("greedy") as outbox:
        for _ in range(400):  # 10/s, bursts of 20, on this server: a 429 comes unless a read takes 100 ms
            started = time.monotonic()
            page = outbox.operations(limit=1)
            if waits():
                break
    # The refused read was asked again, no sooner than its Retry-After (1 s), and answered (a page,
    # empty when no other test of the module ran before it in this process: the order is random and
    # each xdist process has a `served` of its own; "greedy" may read only).
    assert waits() and min(waits()) >= 1.0 and time.monotonic() - started >= 1.0
    assert isinstance(page.operations, list)


def test_the_async_client(served):
    async def scenario() -> tuple[Any, Any, list[str]]:
        async with AsyncOutboxClient(served.url, served.keys["agent"]) as outbox:
            op = await outbox.submit(TICKET, _ticket("async printer"), idempotency_key="cl-async")
            assert op.new is True
            done = await outbox.wait(op.operation_id, timeout_s=30)
            again = await outbox.submit(TICKET, _ticket("async printer"), idempotency_key="cl-async")
            with pytest.raises(IdempotencyConflict):
                await outbox.submit(TICKET, _ticket("other"), idempotency_key="cl-async")
            with pytest.raises(NotFound):
                await outbox.get("no-such-operation")
            listed = [o.operation_id async for o in outbox.iter_operations(idempotency_key="cl-async")]
            return done, again, listed

    done, again, listed = asyncio.run(scenario())
    assert done.outcome == "SUCCEEDED" and again.new is False and listed == [done.operation_id]
    assert _effects(served, "cl-async") == 1

    # Its lost answer is asked again with the same key too.
    proxy = DroppingProxy(served.url, drop=1)

    async def lost() -> Any:
        async with AsyncOutboxClient(proxy.url, served.keys["agent"]) as outbox:
            return await outbox.submit(TICKET, _ticket("lost async"), idempotency_key="cl-async-lost")

    try:
        op = asyncio.run(lost())
        assert proxy.dropped == 1 and op.new is False
        assert proxy.seen.decode().count("POST /v1/intents HTTP/1.1") == 2
    finally:
        proxy.close()


def test_runs(served):
    steps = [{"name": "open", "action": TICKET, "args": _ticket("run printer")}]
    with served.client() as outbox:
        run = outbox.submit_run("cl-run", steps)
        assert run.new is True and run.run_key == "cl-run"
        assert outbox.submit_run("cl-run", steps).new is False
        with pytest.raises(RunConflict) as changed:
            outbox.submit_run("cl-run", [dict(steps[0], args=_ticket("other"))])
        assert changed.value.run_id == run.run_id and changed.value.field == "run_key"
        wait_for(lambda: outbox.get_run(run.run_id).outcome == "SUCCEEDED", 30, 0.3, what="the run succeeded")
    assert _effects(served, "cl-run:open") == 1


def test_operators_approve_deny_and_resolve_a_handoff(served):
    with served.client() as agent, served.client("both") as both, served.client("operator") as operator:
        waiting = agent.submit(REFUND, BIG, idempotency_key="cl-approve")
        denied = agent.submit(REFUND, BIG, idempotency_key="cl-deny")
        assert agent.wait(waiting.operation_id, timeout_s=5).outcome == "AWAITING_APPROVAL"  # settled: at once
        with pytest.raises(Forbidden):
            agent.approvals()
        mine = both.submit(REFUND, BIG, idempotency_key="cl-self")
        with pytest.raises(SeparationOfDuties) as selfish:
            both.approve(mine.operation_id, by="someone-else")
        assert selfish.value.status == 403 and selfish.value.kind == "separation-of-duties"

        pending = {a.operation_id for a in operator.approvals()}
        assert {waiting.operation_id, denied.operation_id, mine.operation_id} <= pending
        approval = operator.approve(waiting.operation_id, by="alice", note="checked the order")
        assert approval.decision == "approved" and approval.args_digest == waiting.args_digest
        assert operator.deny(denied.operation_id, by="bob", note="duplicate").decision == "denied"
        assert agent.wait(waiting.operation_id, timeout_s=30).outcome == "SUCCEEDED"
        assert agent.get(denied.operation_id).outcome == "CANCELLED"

        # An answer lost at the provider and a lookup that cannot tell: a person decides.
        served.sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern="acme:cl-handoff", count=1)
        served.sandbox.add_fault(mode="unavailable_503", method="GET", key_pattern="acme:cl-handoff")
        lost = agent.submit(REFUND, REFUND_ARGS, idempotency_key="cl-handoff")
        assert agent.wait(lost.operation_id, timeout_s=60).outcome == "NEEDS_HUMAN"
        [handoff] = [h for h in operator.handoffs() if h.operation_id == lost.operation_id]
        assert operator.handoff(handoff.handoff_id).packet
        ref = served.sandbox.effects(key="acme:cl-handoff")[0]["object_id"]
        resolved = operator.resolve_handoff(
            handoff.handoff_id, resolution="succeeded", reference=ref, note="found in the dashboard", by="ada"
        )
        assert resolved.operation_status == "succeeded" and resolved.resolved_by
        assert agent.get(lost.operation_id).outcome == "SUCCEEDED"
    assert (
        _effects(served, "cl-approve") == 1 and _effects(served, "cl-deny") == 0 and _effects(served, "cl-handoff") == 1
    )


# -- no server needed ---------------------------------------------------------------------


def test_the_client_runs_on_a_core_install():
    """Nothing from an optional extra: with those packages unimportable, the client imports and the
    server's half (producer.http) stays unloaded."""
    extras = ("fastapi", "starlette", "uvicorn", "jinja2", "aiohttp", "mcp", "agents", "langgraph", "multipart")
    code = (
        "import sys\n"
        f"for name in {extras!r}: sys.modules[name] = None\n"
        "import producer.remote\n"
        "assert not [m for m in sys.modules if m.startswith('producer.http')], 'producer.http loaded'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _answer(status: int, body: Any = None, content: bytes | None = None, **headers: str) -> httpx.Response:
    if content is None:
        return httpx.Response(status, json=body, headers=headers)
    return httpx.Response(status, content=content, headers=headers)


def test_answers_map_to_their_problem_types_and_the_retry_rule():
    from producer.http.problems import PROBLEM_BASE as SERVERS

    assert PROBLEM_BASE == SERVERS
    newer = problem_of(
        _answer(418, {"type": PROBLEM_BASE + "teapot", "title": "T", "status": 418, "detail": "d", "x": 1})
    )
    assert type(newer) is OutboxProblem and newer.kind == "teapot" and newer.body["x"] == 1
    html = problem_of(_answer(502, content=b"<html>bad gateway</html>"))
    assert isinstance(html, Unavailable) and html.status == 502 and "bad gateway" in html.detail
    unconfigured = problem_of(
        _answer(503, {"type": PROBLEM_BASE + "not-configured", "title": "N", "status": 503, "detail": "d"})
    )
    assert isinstance(unconfigured, NotConfigured)

    policy = RetryPolicy(max_retry_after_s=30)
    limited = problem_of(
        _answer(429, {"type": PROBLEM_BASE + "rate-limited", "title": "T", "status": 429, "detail": "d"}),
        retry_after_s=1.0,
    )
    assert isinstance(limited, RateLimited)
    assert policy.may_retry(limited, replay_safe=False)  # not processed: always
    assert policy.may_retry(problem_of(_answer(503, {})), replay_safe=False)
    assert not policy.may_retry(problem_of(_answer(503, {}), retry_after_s=3600), replay_safe=True)  # too long a wait
    assert not policy.may_retry(unconfigured, replay_safe=True)  # waiting will not mend it
    assert policy.may_retry(html, replay_safe=True) and not policy.may_retry(html, replay_safe=False)
    for status in (400, 401, 403, 404, 409, 413, 422, 500):
        assert not policy.may_retry(problem_of(_answer(status, {})), replay_safe=True), status
    sent = OutboxUnreachable("POST", "/v1/intents", reached_server=True)
    assert policy.may_retry(sent, replay_safe=True) and not policy.may_retry(sent, replay_safe=False)
    assert policy.may_retry(OutboxUnreachable("POST", "/", reached_server=False), replay_safe=False)

    from datetime import UTC, datetime

    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_s(_answer(429, {}, **{"Retry-After": "3"}), now) == 3.0
    assert retry_after_s(_answer(429, {}, **{"Retry-After": "Thu, 01 Jan 2026 12:00:05 GMT"}), now) == 5.0
    assert retry_after_s(_answer(429, {}, **{"Retry-After": "soon"}), now) is None
    assert retry_after_s(_answer(429, {}), now) is None
