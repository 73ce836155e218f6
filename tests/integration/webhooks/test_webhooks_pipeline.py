"""Webhooks as fenced evidence through the real pipeline: the sandbox signs and POSTs its events to a real
``agent-outbox serve`` (subprocess) over PostgreSQL, beside a real relay, Celery worker and Redis.

Lookups cannot settle anything here (the sandbox's lookup endpoint answers 503 throughout), so what
settles an operation is the provider's event: an unknown outcome (the answer lost after the provider
committed) and an accepted (pending) operation, each way of signing (Standard Webhooks, Stripe). A
forged, a stale and a replayed event change nothing; a tenant's secret settles nothing of another
tenant's; an event for no operation is the report's document without record.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.models import Evidence, Operation
from outbox.ledger.webhook_models import WebhookEvent
from tests.conftest import scratch_pg_database
from tests.harness import action, actions_doc, pipeline, wait_for
from tests.integration.surfaces.test_api import _serve
from workers.sandbox.webhooks import signed_headers

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _secret(seed: str) -> str:
    return "whsec_" + base64.b64encode(seed.encode().ljust(32, b"-")).decode()


SECRETS = {
    "HOOK_STANDARD": _secret("the hooks target"),
    "HOOK_STRIPE": "whsec_stripe_endpoint_secret",
    "HOOK_T1": _secret("tenant one"),
    "HOOK_T2": _secret("tenant two"),
}
MAPPING = {
    "object": "data.object",
    "key": "idempotency_key",
    "succeeded": ["refund.succeeded"],
    "failed": ["refund.failed"],
    "pending": ["refund.pending"],
}
LOOKUPS_DOWN = {"mode": "unavailable_503", "method": "GET", "path": "/v1/refunds"}
ARGS = {"order_id": "o-1", "amount": "12.50", "currency": "EUR"}


@dataclass
class Served:
    url: str
    pipe: Any
    sandbox: Any

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", content=body, headers=headers, timeout=10)

    def op(self, op_id: str) -> Operation:
        op: Operation = self.pipe.op(op_id)
        return op

    def count(self, model: Any, op_id: str) -> int:
        with self.pipe.sessions() as s:
            return int(
                s.execute(select(func.count()).select_from(model).where(model.operation_id == op_id)).scalar_one()
            )

    def events(self) -> int:
        with self.pipe.sessions() as s:
            return int(s.execute(select(func.count()).select_from(WebhookEvent)).scalar_one())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_url: str, sandbox_server: Any) -> Iterator[Served]:
    sandbox_server.reset()
    url = sandbox_server.url
    doc = actions_doc(url)
    doc["targets"] = {
        "hooks": doc["targets"]["sandbox"] | {"webhooks": {"scheme": "standard", "secret": "${HOOK_STANDARD}"}},
        "stripe": doc["targets"]["sandbox"] | {"webhooks": {"scheme": "stripe", "secret": "${HOOK_STRIPE}"}},
        "tenanted": doc["targets"]["sandbox"]
        | {
            "webhooks": {"scheme": "standard"},  # no secret of the target's own: each tenant has one
            "tenants": {
                t: {"headers": {"Authorization": f"Bearer {t}"}, "webhook_secret": f"${{HOOK_{t.upper()}}}"}
                for t in ("t1", "t2")
            },
        },
    }
    doc["actions"] = {
        f"{target}.refund.create": action("/v1/refunds", target=target, decimal_args=["amount"], webhooks=MAPPING)
        for target in ("hooks", "stripe", "tenanted")
    }
    with scratch_pg_database(f"outbox_test_hooks_{uuid.uuid4().hex[:10]}") as db_url:
        engine = make_engine(db_url)
        sessions = make_sessionmaker(engine)
        tmp = tmp_path_factory.mktemp("hooks")
        with pipeline(db_url=db_url, sessions=sessions, redis_url=redis_url, tmp=tmp, sandbox_url=url) as pipe:
            pipe.env.update(SECRETS)
            pipe.write_actions(doc)
            pipe.start_worker()
            pipe.start_relay()
            with _serve(pipe) as api:
                yield Served(api.url, pipe, sandbox_server)
        engine.dispose()


@pytest.fixture
def hooks(served: Served) -> Served:
    served.sandbox.reset()
    served.sandbox.add_fault(**LOOKUPS_DOWN)  # no lookup can settle anything in these tests
    return served


def _configure(s: Served, target: str, *, held: bool, **more: Any) -> None:
    scheme = "stripe" if target == "stripe" else "standard"
    secret = SECRETS["HOOK_STRIPE" if target == "stripe" else "HOOK_STANDARD"]
    s.sandbox.configure(
        webhook_url=f"{s.url}/v1/webhooks/{target}",
        webhook_scheme=scheme,
        webhook_secret=secret,
        webhooks_held=held,
        **more,
    )


def _unknown(s: Served, target: str, key: str, tenant: str = "t1") -> str:
    """An operation whose answer was lost after the provider committed: outcome_unknown, its lookups down."""
    s.sandbox.add_fault(
        mode="commit_then_drop", method="POST", path="/v1/refunds", key_pattern=f"{tenant}:{key}", count=1
    )
    op_id = s.pipe.submit(key, dict(ARGS), action=f"{target}.refund.create", tenant=tenant).operation_id
    s.pipe.wait_status(op_id, "outcome_unknown")
    return op_id


def _delivery(s: Served, key: str, kind: str) -> dict[str, Any]:
    """The sandbox's event of type ``kind`` for the object created with ``key``."""

    def found() -> dict[str, Any] | None:
        for d in s.sandbox.webhooks():
            obj = json.loads(d["body"])["data"]["object"]
            if obj["idempotency_key"] == key and d["type"] == kind:
                return d
        return None

    return wait_for(found, 10, what=f"the sandbox's {kind} event for {key}")


def _answered(s: Served, delivery_id: int, status: int = 200) -> dict[str, Any]:
    return wait_for(
        lambda: next((d for d in s.sandbox.webhooks() if d["id"] == delivery_id and d["status"] == status), None),
        10,
        what=f"webhook {delivery_id} answered {status}",
    )


def _settled(s: Served, op_id: str, status: str) -> Operation:
    """The operation once in ``status``; on a timeout, what the sandbox sent and was answered."""

    def sent() -> str:
        shown = [{k: d[k] for k in ("id", "type", "url", "status", "attempts")} for d in s.sandbox.webhooks()]
        return f"{op_id} in {status} (now {s.op(op_id).status}); the sandbox's webhooks: {shown}"

    op: Operation = wait_for(lambda: (op := s.op(op_id)).status == status and op, 20, what=sent)
    return op


def _no_lookup_settled(s: Served, op_id: str, target: str) -> None:
    lookups = [a for a in s.pipe.attempts(op_id, "lookup") if a.worker != f"webhook:{target}"]
    assert all(a.attempt_class != "succeeded" for a in lookups), [(a.attempt_class, a.error) for a in lookups]
    [event_row] = [a for a in s.pipe.attempts(op_id, "lookup") if a.worker == f"webhook:{target}"]
    assert event_row.attempt_class == "succeeded" and event_row.stale and event_row.applied_at is not None


@pytest.mark.parametrize("target", ["hooks", "stripe"])
def test_a_signed_webhook_settles_an_unknown_and_an_accepted_operation_before_any_lookup(hooks, target):
    s = hooks
    key = f"{target}-u-{uuid.uuid4().hex[:6]}"
    _configure(s, target, held=True)
    op_id = _unknown(s, target, key)
    assert s.op(op_id).status == "outcome_unknown"
    [made] = s.sandbox.effects(key=f"t1:{key}")
    s.sandbox.release_webhooks()
    op = _settled(s, op_id, "succeeded")
    assert op.result_reference == made["object_id"] and "evidence wins" in op.reason
    assert _answered(s, _delivery(s, f"t1:{key}", "refund.succeeded")["id"])["status"] == 200
    _no_lookup_settled(s, op_id, target)
    assert len(s.sandbox.effects(key=f"t1:{key}")) == 1 and s.count(Evidence, op_id) == 1

    # Accepted: the provider answers 202 "pending"; the event when it settles ends it.
    _configure(s, target, held=False, processing_s=30, processing_status=202)
    key = f"{target}-a-{uuid.uuid4().hex[:6]}"
    op_id = s.pipe.submit(key, dict(ARGS), action=f"{target}.refund.create").operation_id
    s.pipe.wait_status(op_id, "accepted")
    _answered(s, _delivery(s, f"t1:{key}", "refund.pending")["id"])  # kept; nothing moves
    assert s.op(op_id).status == "accepted"
    s.sandbox.advance_clock(31)  # the provider finishes: its refund.succeeded event follows
    op = _settled(s, op_id, "succeeded")
    assert op.result_reference == s.sandbox.effects(key=f"t1:{key}")[0]["object_id"]
    assert op.result is not None and op.result["status"] == "succeeded"
    _no_lookup_settled(s, op_id, target)


def test_a_failed_event_ends_an_accepted_operation_failed_at_provider_once_a_lookup_reads_it(hooks):
    # A failure event settles nothing by itself (events come in any order): the lookup it causes does.
    s = hooks
    s.sandbox.clear_faults()  # lookups answer here
    _configure(s, "hooks", held=False, processing_s=30, processing_status=202, processing_fails="t1:fails-*")
    op_id = s.pipe.submit(f"fails-{uuid.uuid4().hex[:6]}", dict(ARGS), action="hooks.refund.create").operation_id
    s.pipe.wait_status(op_id, "accepted")
    s.sandbox.advance_clock(31)
    op = _settled(s, op_id, "failed_at_provider")
    assert op.reason.startswith("reconciled:")
    assert [a for a in s.pipe.attempts(op_id, "lookup") if a.worker == "webhook:hooks"] == []


def test_forged_stale_and_replayed_webhooks_change_nothing_and_a_stray_one_is_reported(hooks):
    s = hooks
    _configure(s, "hooks", held=True)
    key = f"guard-{uuid.uuid4().hex[:6]}"
    op_id = _unknown(s, "hooks", key)
    held = _delivery(s, f"t1:{key}", "refund.succeeded")
    body, event_id = held["body"].encode(), json.loads(held["body"])["id"]
    events_before = s.events()

    forged = s.post("/v1/webhooks/hooks", body, signed_headers("standard", _secret("not ours"), event_id, body))
    assert forged.status_code == 401 and forged.headers["content-type"] == "application/problem+json"
    stale_at = int(time.time()) - 600
    stale = s.post(
        "/v1/webhooks/hooks", body, signed_headers("standard", SECRETS["HOOK_STANDARD"], event_id, body, stale_at)
    )
    assert stale.status_code == 400 and "tolerance" in stale.json()["detail"]
    tampered = body.replace(b"succeeded", b"succeedeX")
    headers = signed_headers("standard", SECRETS["HOOK_STANDARD"], event_id, body)
    assert s.post("/v1/webhooks/hooks", tampered, headers).status_code == 401
    assert s.post("/v1/webhooks/nowhere", body, headers).status_code == 404
    assert s.events() == events_before  # nothing stored for any of them
    assert s.op(op_id).status == "outcome_unknown"
    assert [a for a in s.pipe.attempts(op_id, "lookup") if a.worker == "webhook:hooks"] == []

    s.sandbox.release_webhooks()
    sent = _answered(s, held["id"])
    settled = _settled(s, op_id, "succeeded")
    # A captured request sent again, byte for byte and inside the tolerance: 2xx, no second effect.
    replay = s.post("/v1/webhooks/hooks", body, sent["headers"])
    assert replay.status_code == 200 and replay.json() == {
        "event_id": event_id,
        "duplicate": True,
        "disposition": "settled",
    }
    # The provider's own retry (same id, signed anew).
    s.sandbox.redeliver_webhook(held["id"])
    wait_for(lambda: next(d for d in s.sandbox.webhooks() if d["id"] == held["id"])["attempts"] == 2, 10)
    op = s.op(op_id)
    assert (op.status, op.fencing_token, op.result_reference) == (
        "succeeded",
        settled.fencing_token,
        settled.result_reference,
    )
    assert s.count(Evidence, op_id) == 1
    assert len([a for a in s.pipe.attempts(op_id, "lookup") if a.worker == "webhook:hooks"]) == 1

    # A refund nobody asked the outbox for: the provider's event names no operation.
    stray = f"t1:stray-{uuid.uuid4().hex[:6]}"
    created = httpx.post(f"{s.sandbox.url}/v1/refunds", json=ARGS, headers={"Idempotency-Key": stray})
    s.sandbox.release_webhooks()
    _answered(s, _delivery(s, stray, "refund.succeeded")["id"])
    report = _report(s)
    [doc] = [d for d in report["discrepancies"]["document_without_record"] if d["idempotency_key"] == stray]
    assert doc["source"] == "webhook" and doc["reference"] == created.json()["id"] and doc["target"] == "hooks"

    metrics = httpx.get(f"{s.url}/metrics").text
    assert 'outbox_webhooks_rejected_total{target="hooks",why="signature"} 2.0' in metrics
    assert 'outbox_webhooks_rejected_total{target="hooks",why="stale"} 1.0' in metrics
    assert 'outbox_webhooks_verified_total{disposition="duplicate",target="hooks"} 2.0' in metrics


def _report(s: Served) -> dict[str, Any]:
    from workers.provider.actions import load_actions
    from workers.provider.listing_report import build_report

    actions = load_actions(s.pipe.env["OUTBOX_ACTIONS_FILE"], environ=os.environ | s.pipe.env)
    now = dt.datetime.now(dt.UTC)
    with s.pipe.sessions() as session:
        return build_report(session, actions, since=now - dt.timedelta(hours=1), now=now)


def test_a_tenants_secret_cannot_settle_another_tenants_operation(hooks):
    s = hooks
    s.sandbox.configure(
        webhook_url=f"{s.url}/v1/webhooks/tenanted/{{tenant}}",
        webhook_secrets={"t1": SECRETS["HOOK_T1"], "t2": SECRETS["HOOK_T2"]},
        webhooks_held=True,
    )
    key = f"wall-{uuid.uuid4().hex[:6]}"
    theirs = _unknown(s, "tenanted", key, tenant="t2")
    held = _delivery(s, f"t2:{key}", "refund.succeeded")
    body, event_id = held["body"].encode(), json.loads(held["body"])["id"]
    with_t1 = signed_headers("standard", SECRETS["HOOK_T1"], event_id, body)
    # t1's secret at t2's endpoint: refused. At t1's own: verified, and t2's operation is not t1's.
    assert s.post("/v1/webhooks/tenanted/t2", body, with_t1).status_code == 401
    mine = s.post("/v1/webhooks/tenanted/t1", body, with_t1)
    assert mine.status_code == 200 and mine.json()["disposition"] == "no_operation"
    assert s.post("/v1/webhooks/tenanted", body, with_t1).status_code == 404  # no secret of the target's own
    assert s.op(theirs).status == "outcome_unknown"
    # t2's own event, at t2's endpoint, settles it.
    s.sandbox.release_webhooks()
    assert _answered(s, held["id"])["url"].endswith("/v1/webhooks/tenanted/t2")
    _settled(s, theirs, "succeeded")
