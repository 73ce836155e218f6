"""Traces (issue 33): an intent's story is one trace, from the agent's span through its submit, the
relay's publish, each claim and attempt, the lookup that settled an unknown, and a handoff and its
resolution, in whatever process each happened.

In-process parts use the SDK's in-memory exporter (a provider of the test's own, never the global
one). The workers and the relay are real processes: they export over OTLP/HTTP, configured by the
standard OTEL_* variables, to a receiver in this test, which decodes what arrives (the OTLP test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from outbox.errors import InvalidIntent
from outbox.ledger import tracing
from outbox.ledger.models import Handoff
from outbox.ledger.tracing import validate_traceparent
from producer.tracing import OpenTelemetryTracer
from tests import spawn
from tests.harness import REFUND_ARGS, actions_doc, pk, wait_for

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
AGENT_SPAN = "00f067aa0ba902b7"
AGENT = f"00-{TRACE}-{AGENT_SPAN}-01"  # the agent's own span, as its framework would pass it


@dataclass(frozen=True)
class Got:
    name: str
    trace_id: str
    span_id: str
    parent: str
    client: bool
    attributes: dict[str, Any]
    error: bool
    links: tuple[str, ...]
    service: str


@dataclass
class Receiver:
    """An OTLP/HTTP receiver: POST /v1/traces, protobuf, every span kept."""

    url: str = ""
    spans: list[Got] = field(default_factory=list)
    posts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    got.append(
                        Got(s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.kind == 3, attrs,
                            s.status.code == 2, tuple(link.trace_id.hex() for link in s.links), service)
                    )  # fmt: skip
        with self.lock:
            self.posts += 1
            self.spans += got

    def named(self, name: str, operation_id: str | None = None) -> list[Got]:
        with self.lock:
            return [
                s for s in self.spans
                if s.name == name and (operation_id is None or s.attributes.get("outbox.operation_id") == operation_id)
            ]  # fmt: skip


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/traces":
                got.take(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield got
    server.shutdown()
    server.server_close()


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    """The ledger's port on an SDK provider of this test's own, exporting to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(OpenTelemetryTracer(provider))
    yield exporter
    tracing.install(None)


def traced_env(receiver: Receiver, service: str) -> dict[str, str]:
    return {
        "OUTBOX_TRACING": "otel",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }


# -- in-process: the submit span, and what is stored -------------------------------------------------
def test_a_submit_continues_the_callers_trace_and_stores_its_own_span(ledger, memory):
    from outbox.ledger.models import Operation
    from producer import submit

    with ledger.sessions.begin() as s:
        r = submit(
            s, tenant="t", idempotency_key="k1", action="a", args=dict(REFUND_ARGS), subject="x", traceparent=AGENT
        )
    [span] = memory.get_finished_spans()
    ctx = span.get_span_context()
    assert span.name == "outbox.submit" and f"{ctx.trace_id:032x}" == TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == AGENT_SPAN
    assert span.attributes["outbox.operation_id"] == r.operation_id and span.attributes["outbox.replay"] is False
    with ledger.sessions() as s:
        stored = s.get(Operation, r.operation_id).traceparent
    assert stored == f"00-{TRACE}-{ctx.span_id:016x}-01"  # later work continues the submit span

    # No explicit parent: the caller's current span (an agent framework's tool-call span).
    provider = TracerProvider()
    with provider.get_tracer("agent").start_as_current_span("tool call") as agent_span:
        with ledger.sessions.begin() as s:
            r2 = submit(s, tenant="t", idempotency_key="k2", action="a", args=dict(REFUND_ARGS), subject="x")
    with ledger.sessions() as s:
        stored = s.get(Operation, r2.operation_id).traceparent
    assert stored and stored.split("-")[1] == f"{agent_span.get_span_context().trace_id:032x}"


def test_without_a_tracer_an_explicit_traceparent_is_stored_as_given(ledger):
    from outbox.ledger.models import Operation
    from producer import submit

    tracing.install(None)
    with ledger.sessions.begin() as s:
        r = submit(
            s,
            tenant="t",
            idempotency_key="k",
            action="a",
            args=dict(REFUND_ARGS),
            subject="x",
            traceparent=AGENT.upper(),
        )
        again = submit(s, tenant="t", idempotency_key="k", action="a", args=dict(REFUND_ARGS), subject="x")
    assert again.operation_id == r.operation_id and not again.new  # not part of the intent's identity
    with ledger.sessions() as s:
        assert s.get(Operation, r.operation_id).traceparent == AGENT


@pytest.mark.parametrize(
    "bad",
    ["nope", f"01-{TRACE}-{AGENT_SPAN}-01", f"00-{'0' * 32}-{AGENT_SPAN}-01", f"00-{TRACE}-{'0' * 16}-01", 7],
)
def test_a_malformed_traceparent_is_refused_naming_it(bad):
    with pytest.raises(InvalidIntent) as exc:
        validate_traceparent(bad)
    assert exc.value.field == "traceparent" and "W3C trace context" in exc.value.reason


def test_the_api_stores_the_traceparent_header(ledger, tmp_path):
    from fastapi.testclient import TestClient

    from outbox.access.keys import create_key
    from outbox.ledger.models import Operation
    from outbox.settings import Settings
    from workers.server.app import create_app

    tracing.install(None)
    with ledger.sessions.begin() as s:
        key, _ = create_key(s, tenant="t1", scopes=["submit", "read"])
    body = {"idempotency_key": "h-1", "action": "payments.refund.create", "args": REFUND_ARGS}
    headers = {"Authorization": f"Bearer {key}", "traceparent": AGENT}
    with TestClient(create_app(Settings(database_url=ledger.url, data_dir=tmp_path))) as client:
        created = client.post("/v1/intents", json=body, headers=headers)
        bad = client.post("/v1/intents", json=body | {"idempotency_key": "h-2"}, headers=headers | {"traceparent": "x"})
    assert created.status_code == 201, created.text
    with ledger.sessions() as s:
        assert s.get(Operation, created.json()["operation_id"]).traceparent == AGENT
    assert bad.status_code == 422 and bad.json()["field"] == "traceparent (header)"


# -- real processes, over OTLP/HTTP -----------------------------------------------------------------
@pytest.mark.postgres
@pytest.mark.redis
def test_a_retried_operation_an_unknown_settled_by_lookup_and_a_handoff_are_each_one_trace(
    pipe, sandbox, receiver, tmp_path
):
    # 1: a 503 then a success (retried); 2: committed then the answer lost (unknown, found by lookup);
    # 3: committed then lost, and the lookup down for good with a budget of 1 (a person decides).
    sandbox.add_fault(mode="unavailable_503", method="POST", key_pattern=pk("tr-retry"), count=1)
    sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("tr-unknown"), count=1)
    sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("tr-person"), count=1)
    sandbox.add_fault(mode="fail_before_commit", method="GET", key_pattern=pk("tr-person"), status=500)
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["propagate_trace"] = True  # the provider sees each call's span
    pipe.write_actions(doc)
    env = traced_env(receiver, "outbox-worker") | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "1"}
    pipe.env.update({"OUTBOX_RECONCILE_MAX_LOOKUPS": "1"})
    pipe.start_worker(extra_env=env)
    relay = spawn.popen(
        [sys.executable, "-m", "workers.cli.main", "relay"],
        env=dict(os.environ) | pipe.env | traced_env(receiver, "outbox-relay"),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        ids = {
            key: pipe.submit(key, dict(REFUND_ARGS, order_id=key), traceparent=AGENT).operation_id
            for key in ("tr-retry", "tr-unknown", "tr-person")
        }
        retried = ids["tr-retry"]
        pipe.wait_attempt_done(retried, 1)
        pipe.advance_to_due(retried)
        pipe.wait_status(retried, "succeeded", timeout_s=30)
        unknown = ids["tr-unknown"]
        pipe.wait_attempt_done(unknown, 1)
        pipe.advance_to_due(unknown)
        pipe.wait_status(unknown, "succeeded", timeout_s=30)
        person = ids["tr-person"]
        pipe.wait_attempt_done(person, 1)
        pipe.advance_to_due(person)
        pipe.wait_status(person, "reconciliation_required", timeout_s=30)
        # A person resolves it (the CLI, another process, traced too).
        with pipe.sessions() as s:
            handoff_id = s.execute(select(Handoff.id).where(Handoff.operation_id == person)).scalar_one()
        reference = sandbox.effects(key=pk("tr-person"))[0]["object_id"]
        resolved = spawn.run(
            [sys.executable, "-m", "workers.cli.main", "handoffs", "resolve", str(handoff_id), "--as", "succeeded",
             "--reference", reference, "--note", "checked the provider's dashboard", "--by", "alice"],
            env=dict(os.environ) | pipe.env | traced_env(receiver, "outbox-cli"), capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert resolved.returncode == 0, resolved.stderr
        wait_for(lambda: receiver.named("outbox.handoff.resolve", person), 20, what="the resolution's span")
        wait_for(lambda: len(receiver.named("outbox.attempt", retried)) == 2, 20, what="both attempts' spans")
        wait_for(lambda: receiver.named("outbox.settle", unknown), 20, what="the settlement's span")
        wait_for(lambda: receiver.named("outbox.relay.publish"), 20, what="a publish span")
    finally:
        relay.send_signal(signal.SIGTERM)
        try:
            relay.wait(timeout=20)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()

    assert receiver.posts >= 1 and len(sandbox.effects(key=pk("tr-retry"))) == 1
    assert len(sandbox.effects(key=pk("tr-unknown"))) == 1
    everything = receiver.spans
    assert {s.trace_id for s in everything if s.attributes.get("outbox.operation_id") in ids.values()} == {TRACE}

    # 1. Retried: two attempt spans (client spans), both children of the agent's span in its trace:
    # the first not_processed with the provider's 503, the second succeeded with its 2xx; no ERROR.
    first, second = sorted(receiver.named("outbox.attempt", retried), key=lambda s: s.attributes["outbox.attempt"])
    assert all(s.client and s.parent == AGENT_SPAN and s.trace_id == TRACE and not s.error for s in (first, second))
    assert (first.attributes["outbox.attempt.class"], first.attributes["http.response.status_code"]) == (
        "not_processed",
        503,
    )
    assert (
        second.attributes["outbox.attempt.class"] == "succeeded"
        and second.attributes["outbox.fencing_token"] > (first.attributes["outbox.fencing_token"])
    )
    assert {s.attributes["outbox.attempt"] for s in receiver.named("outbox.claim", retried)} == {1, 2}
    # propagate_trace: each call carried its own attempt span as traceparent.
    carried = [r["traceparent"] for r in sandbox.requests(method="POST", key=pk("tr-retry"))]
    assert carried == [f"00-{TRACE}-{s.span_id}-01" for s in (first, second)]

    # 2. Unknown, settled by a lookup: the attempt ambiguous, the lookup a client span that found it,
    # the settlement succeeded; all in the agent's trace (a lookup in another process, later).
    [lost] = receiver.named("outbox.attempt", unknown)
    [lookup] = receiver.named("outbox.lookup", unknown)
    [settled] = receiver.named("outbox.settle", unknown)
    assert lost.attributes["outbox.attempt.class"] == "ambiguous" and not lost.error
    assert lookup.client and lookup.attributes["outbox.lookup.outcome"] == "found" and lookup.parent == AGENT_SPAN
    assert settled.attributes["outbox.status"] == "succeeded" and settled.trace_id == TRACE

    # 3. A person: the settlement to reconciliation_required, its handoff span beneath it, and the
    # resolution (from the CLI's process) in the same trace.
    [to_person] = receiver.named("outbox.settle", person)
    [handoff] = [s for s in receiver.named("outbox.handoff") if s.attributes.get("outbox.operation_id") == person]
    [resolve] = receiver.named("outbox.handoff.resolve", person)
    assert to_person.attributes["outbox.status"] == "reconciliation_required"
    assert handoff.parent == to_person.span_id and handoff.trace_id == TRACE
    assert resolve.trace_id == TRACE and resolve.parent == AGENT_SPAN and resolve.service == "outbox-cli"
    assert resolve.attributes["outbox.status"] == "succeeded"

    # The relay's publishes continue (one operation) or link to (several) the traces they ring.
    publishes = receiver.named("outbox.relay.publish")
    assert any(p.trace_id == TRACE or TRACE in p.links for p in publishes)
    assert {s.service for s in everything} >= {"outbox-worker", "outbox-relay", "outbox-cli"}
