"""The sandbox as a provider that compares a key's requests (Stripe) and as one that does not."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import httpx
import pytest

from workers.sandbox.testing import SandboxServer

ORDER = {"order_ref": "o-1", "amount_cents": 500}


@pytest.fixture
def client(sandbox: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
        yield c


def create(client: httpx.Client, body: dict[str, object], path: str = "/v1/orders") -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"Idempotency-Key": "k1"})


def test_a_known_key_with_another_query_or_body_is_refused_as_stripe_does(client, sandbox):
    sandbox.configure(params_mismatch_status=400)
    first = create(client, ORDER)
    assert first.status_code == 200
    for path, body in (("/v1/orders?v=2", ORDER), ("/v1/orders", {**ORDER, "amount_cents": "500"})):
        refused = create(client, body, path)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "idempotency_error"
    replayed = create(client, ORDER)
    assert replayed.json()["id"] == first.json()["id"] and replayed.headers["Idempotent-Replayed"] == "true"
    assert len(sandbox.effects(key="k1")) == 1


def test_a_provider_that_does_not_compare_replays_the_first_answer(client, sandbox):
    sandbox.configure(compare_params=False)
    first = create(client, ORDER)
    other = create(client, {**ORDER, "amount_cents": "500"}, "/v1/orders?v=2")
    assert other.status_code == 200 and other.json()["id"] == first.json()["id"]
    assert len(sandbox.effects(key="k1")) == 1


def test_the_request_log_keeps_each_creations_body_and_its_digest(client, sandbox):
    text = json.dumps(ORDER, separators=(",", ":"))
    client.post("/v1/orders?v=2", content=text, headers={"Idempotency-Key": "k2"})
    (entry,) = sandbox.requests(method="POST", key="k2")
    assert (entry["query"], entry["body"]) == ("v=2", text)
    assert entry["body_digest"] == hashlib.sha256(text.encode()).hexdigest()


def test_the_comparison_settings_are_checked(client):
    assert client.post("/admin/config", json={"params_mismatch_status": 400, "compare_params": True}).status_code == 200
    r = client.post("/admin/config", json={"params_mismatch_status": 418})
    assert r.status_code == 400 and r.json()["error"]["param"] == "params_mismatch_status"
