"""Webhooks through the real pipeline (review of issue 50, findings 4, 5, 9): a real ``agent-outbox serve``
(subprocess) over PostgreSQL, beside a real relay, Celery worker, Redis and the sandbox over HTTP.

- tenant walls: a tenant with a provider account of its own and no webhook secret is never settled by
  the target's secret, at its path or the target's; every "no endpoint" answers alike; a captured event
  posted again under another path its secret verifies is not kept again;
- a failure event settles nothing by itself (events come in any order): it makes the lookup run now,
  and a later success is not contradicted;
- events that came before their operation could take them: a failure while a worker still sends it gets
  its lookup as soon as the operation is accepted; a success named by a reference the 202's finalize had
  not recorded yet settles the operation (lookups down), without a person.

The events are the provider's as the sandbox would send them, signed here with the endpoint's secret
(the sandbox's own are held, so only these land). Effects and requests are counted by the sandbox.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from outbox.ledger.models import Handoff
from outbox.ledger.webhook_models import WebhookEvent
from tests.harness import REFUND_ARGS, action, actions_doc, pk, wait_for
from tests.integration.surfaces.test_api import _serve
from workers.sandbox.webhooks import signed_headers

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

SECRET = "whsec_" + base64.b64encode(b"the pay target's endpoint secret").decode()
BY_KEY = {
    "object": "data.object",
    "key": "idempotency_key",
    "succeeded": ["refund.succeeded"],
    "failed": ["refund.failed"],
    "pending": ["refund.pending"],
}
BY_REFERENCE = {k: v for k, v in BY_KEY.items() if k != "key"}  # the reference (id) only
LOOKUPS_DOWN = {"mode": "unavailable_503", "method": "GET", "path": "/v1/refunds"}
# Room for a slow provider: a request may take seconds without its task's time limit cutting it.
SLOW_OK = {"OUTBOX_SOFT_TIME_LIMIT_S": "10", "OUTBOX_TIME_LIMIT_S": "12", "OUTBOX_LEASE_S": "30"}


@contextmanager
def _served(pipe: Any, sandbox: Any) -> Iterator[str]:
    """Workers, relay and the API server over the actions file below; yields the server's URL."""
    doc = actions_doc(sandbox.url, timeout_s=5)
    hooked = doc["targets"]["sandbox"] | {"webhooks": {"scheme": "standard", "secret": "${PAY_HOOK}"}}
    doc["targets"] = {
        "pay": hooked,
        "byref": hooked,
        "walled": hooked
        | {
            "tenants": {
                "acme": {"headers": {"Authorization": "Bearer acme-own-account"}},  # no webhook_secret
                "small": {"rate_limit": {"per_s": 100}},  # no account of its own: the platform's
            }
        },
    }
    # settle_s 30: no lookup comes by itself within a test; only what the events cause.
    doc["actions"] = {
        "pay.refund.create": action("/v1/refunds", target="pay", settle_s=30, decimal_args=["amount"], webhooks=BY_KEY),
        "byref.refund.create": action(
            "/v1/refunds", target="byref", settle_s=30, decimal_args=["amount"], webhooks=BY_REFERENCE
        ),
        "walled.refund.create": action("/v1/refunds", target="walled", decimal_args=["amount"], webhooks=BY_KEY),
    }
    pipe.env.update(SLOW_OK | {"PAY_HOOK": SECRET})
    pipe.write_actions(doc)
    pipe.start_worker()
    pipe.start_relay()
    with _serve(pipe) as api:
        yield api.url


def _signed(kind: str, obj: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    event_id = f"evt_{uuid.uuid4().hex[:12]}"
    body = json.dumps({"id": event_id, "object": "event", "type": kind, "data": {"object": obj}}).encode()
    return body, signed_headers("standard", SECRET, event_id, body)


def _post(url: str, path: str, signed: tuple[bytes, dict[str, str]]) -> httpx.Response:
    body, headers = signed
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=10)


def _events(pipe: Any) -> list[WebhookEvent]:
    with pipe.sessions() as s:
        return list(s.execute(select(WebhookEvent).order_by(WebhookEvent.id)).scalars())


def _handoffs(pipe: Any, op_id: str) -> int:
    with pipe.sessions() as s:
        return int(
            s.execute(select(func.count()).select_from(Handoff).where(Handoff.operation_id == op_id)).scalar_one()
        )


def _lookups(pipe: Any, op_id: str) -> list[Any]:
    """The reconciler's lookups that were answered (not an event's row)."""
    return [a for a in pipe.attempts(op_id, "lookup") if not a.worker.startswith("webhook:") and a.ended_at]


def _posts(sandbox: Any) -> list[dict[str, Any]]:
    return list(sandbox.requests(method="POST", path="/v1/refunds"))


def test_a_tenant_with_its_own_account_is_never_settled_by_the_targets_secret(pipe, sandbox):
    sandbox.add_fault(**LOOKUPS_DOWN)
    key = f"acme-{uuid.uuid4().hex[:6]}"
    sandbox.add_fault(mode="commit_then_drop", method="POST", path="/v1/refunds", key_pattern=f"acme:{key}", count=1)
    with _served(pipe, sandbox) as url:
        op_id = pipe.submit(key, dict(REFUND_ARGS), action="walled.refund.create", tenant="acme").operation_id
        pipe.wait_status(op_id, "outcome_unknown")
        [made] = sandbox.effects(key=f"acme:{key}")
        # The provider's success event for acme's refund, signed with the platform's (target's) secret.
        event = _signed(
            "refund.succeeded", {"id": made["object_id"], "idempotency_key": f"acme:{key}", "status": "succeeded"}
        )
        at_acme = _post(url, "/v1/webhooks/walled/acme", event)
        assert at_acme.status_code == 404  # no endpoint: acme's account signs acme's events, not ours
        at_target = _post(url, "/v1/webhooks/walled", event)
        assert at_target.status_code == 200 and at_target.json()["disposition"] == "no_operation"
        assert pipe.op(op_id).status == "outcome_unknown" and pipe.op(op_id).result_reference is None
        # Every "no endpoint here" is the same answer: nothing tells which tenants exist or have a secret.
        others = [_post(url, path, event) for path in ("/v1/webhooks/walled/nobody", "/v1/webhooks/nowhere/acme")]
        assert [r.status_code for r in others] == [404, 404]
        assert others[0].json() == others[1].json() == at_acme.json()
        # The same signed request posted again where the target's secret verifies it too: kept once.
        again = _post(url, "/v1/webhooks/walled/small", event)
        assert again.status_code == 200 and again.json()["duplicate"] is True
        assert len(_events(pipe)) == 1
        assert len(sandbox.effects(key=f"acme:{key}")) == 1


def test_a_failure_event_makes_the_lookup_run_now_and_a_later_success_is_not_contradicted(pipe, sandbox):
    key = f"ff-{uuid.uuid4().hex[:6]}"
    with _served(pipe, sandbox) as url:
        sandbox.configure(
            processing_s=30,
            processing_status=202,
            webhook_url=f"{url}/v1/webhooks/pay",
            webhook_secret=SECRET,
            webhooks_held=True,
        )
        op_id = pipe.submit(key, dict(REFUND_ARGS), action="pay.refund.create").operation_id
        op = pipe.wait_status(op_id, "accepted")
        assert _lookups(pipe, op_id) == []  # settle_s 30: the first lookup is not due yet
        # An event says it failed (events are unordered: the provider may still complete it).
        failed = {"id": op.result_reference, "idempotency_key": pk(key), "status": "failed"}
        answer = _post(url, "/v1/webhooks/pay", _signed("refund.failed", failed))
        assert answer.status_code == 200 and answer.json()["disposition"] == "recorded"
        # The lookup runs now and reads the provider's object: still pending, so nothing moves.
        [looked] = wait_for(lambda: _lookups(pipe, op_id), 15, what="a lookup caused by the failure event")
        assert looked.attempt_class == "accepted" and pipe.op(op_id).status == "accepted"
        sandbox.advance_clock(31)  # the provider completes it; its events follow
        sandbox.release_webhooks()
        done = pipe.wait_status(op_id, "succeeded", timeout_s=20)
        assert done.result_reference == op.result_reference and _handoffs(pipe, op_id) == 0
        assert len(sandbox.effects(key=pk(key))) == 1 and len(_posts(sandbox)) == 1


def test_a_failure_event_while_in_flight_gets_its_lookup_once_the_operation_is_accepted(pipe, sandbox):
    key = f"fly-{uuid.uuid4().hex[:6]}"
    with _served(pipe, sandbox) as url:
        sandbox.configure(processing_s=2, processing_status=202, processing_fails=pk(key), webhooks_held=True)
        sandbox.add_fault(mode="latency", method="POST", path="/v1/refunds", latency_ms=2500, count=1)
        op_id = pipe.submit(key, dict(REFUND_ARGS), action="pay.refund.create").operation_id
        pipe.wait_status(op_id, "dispatching")
        answer = _post(url, "/v1/webhooks/pay", _signed("refund.failed", {"idempotency_key": pk(key)}))
        assert answer.status_code == 200 and answer.json()["disposition"] == "recorded"
        assert pipe.op(op_id).status == "dispatching"  # the event came while the worker sends it
        # Accepted (202), then looked up at once (not after settle_s=30): failed there, so it ends so.
        op = pipe.wait_status(op_id, "failed_at_provider", timeout_s=20)
        assert op.reason.startswith("reconciled:") and _handoffs(pipe, op_id) == 0
        assert [a.attempt_class for a in _lookups(pipe, op_id)][-1] == "rejected"
        assert len(_posts(sandbox)) == 1


def test_a_success_named_by_a_reference_not_recorded_yet_settles_the_operation_without_a_person(pipe, sandbox):
    key = f"ref-{uuid.uuid4().hex[:6]}"
    sandbox.add_fault(**LOOKUPS_DOWN)  # only the event can settle it
    with _served(pipe, sandbox) as url:
        sandbox.configure(processing_s=60, processing_status=202, webhooks_held=True)
        # The provider commits, then takes 2.5 s to answer 202: its event comes first.
        sandbox.add_fault(mode="commit_then_stall", method="POST", path="/v1/refunds", stall_s=2.5, count=1)
        op_id = pipe.submit(key, dict(REFUND_ARGS), action="byref.refund.create").operation_id
        [made] = wait_for(lambda: sandbox.effects(key=pk(key)), 10, what="the provider's commit")
        assert pipe.op(op_id).status == "dispatching"
        event = _signed("refund.succeeded", {"id": made["object_id"], "status": "succeeded"})
        answer = _post(url, "/v1/webhooks/byref", event)
        assert answer.status_code == 200 and answer.json()["disposition"] == "no_operation"
        op = pipe.wait_status(op_id, "succeeded", timeout_s=20)
        assert op.result_reference == made["object_id"] and "before its operation could take it" in op.reason
        assert _handoffs(pipe, op_id) == 0 and len(_posts(sandbox)) == 1
        [row] = _events(pipe)
        assert (row.disposition, row.operation_id, row.outcome, row.moved_to) == (
            "settled",
            op_id,
            "succeeded",
            "succeeded",
        )
