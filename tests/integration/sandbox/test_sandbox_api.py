"""The sandbox's careful-provider behaviour, over real HTTP: idempotency, lookups, fencing, admin."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.sandbox.testing import SandboxProcess, SandboxServer

REFUND = {"order_id": "ord-17", "amount": "12.50", "currency": "EUR", "reason": "duplicate"}


# `sandbox` (tests/conftest.py): one SandboxServer for the session, reset before each test.


@pytest.fixture
def client(sandbox: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
        yield c


def post(
    client: httpx.Client, key: str | None, body: dict[str, Any] | None = None, path: str = "/v1/refunds", **headers: str
) -> httpx.Response:
    h = {k.replace("_", "-"): v for k, v in headers.items()}
    if key is not None:
        h["Idempotency-Key"] = key
    return client.post(path, json=REFUND if body is None else body, headers=h)


def test_refund_created_with_id_status_and_request_id(client: httpx.Client, sandbox: SandboxServer) -> None:
    r = post(client, "k1")
    assert r.status_code == 200
    obj = r.json()
    assert obj["id"].startswith("re_") and obj["object"] == "refund" and obj["status"] == "succeeded"
    assert (obj["order_id"], obj["amount"], obj["currency"], obj["reason"]) == ("ord-17", "12.50", "eur", "duplicate")
    assert obj["idempotency_key"] == "k1" and isinstance(obj["created"], float)
    assert r.headers["Request-Id"].startswith("req_")
    assert [e["object_id"] for e in sandbox.effects()] == [obj["id"]]


def test_tickets_and_emails(client: httpx.Client) -> None:
    t = post(client, "t1", {"subject": "Broken", "body": "x", "priority": "high", "customer_id": "c1"}, "/v1/tickets")
    assert t.status_code == 200 and t.json()["id"].startswith("tk_") and t.json()["status"] == "open"
    e = post(client, "e1", {"to": "a@example.com", "subject": "Hi", "body": "x"}, "/v1/emails")
    assert e.status_code == 200 and e.json()["id"].startswith("em_") and e.json()["status"] == "sent"
    assert post(client, "t2", {"subject": "x"}, "/v1/tickets").json()["error"]["param"] == "customer_id"
    assert (
        post(client, "e2", {"to": "nobody", "subject": "Hi"}, "/v1/emails").json()["error"]["code"] == "invalid_email"
    )


def test_every_response_has_a_request_id(client: httpx.Client) -> None:
    for r in (client.get("/nope"), client.get("/admin/health"), post(client, None, {})):
        assert r.headers["Request-Id"]


def test_replay_returns_the_stored_response_byte_for_byte(client: httpx.Client, sandbox: SandboxServer) -> None:
    first = post(client, "k-replay")
    sandbox.advance_clock(3600)  # an hour later (inside the 24 h retention): still the same bytes
    second = post(client, "k-replay")
    assert second.status_code == first.status_code == 200
    assert second.content == first.content
    assert second.headers["Idempotent-Replayed"] == "true"
    assert second.headers["Original-Request"] == first.headers["Request-Id"]
    assert len(sandbox.effects()) == 1
    assert [e["replayed"] for e in sandbox.requests(key="k-replay")] == [False, True]


def test_same_key_different_parameters_is_refused(client: httpx.Client, sandbox: SandboxServer) -> None:
    post(client, "k-mismatch")
    r = post(client, "k-mismatch", {**REFUND, "amount": "13.00"})
    assert r.status_code == 409
    assert r.json()["error"]["type"] == "idempotency_error" and r.json()["error"]["code"] == "idempotency_error"
    # The same key on another endpoint is a mismatch too (Stripe compares the endpoint).
    assert post(client, "k-mismatch", {"to": "a@b.c", "subject": "s"}, "/v1/emails").status_code == 409
    assert len(sandbox.effects()) == 1


def test_keys_are_scoped_by_tenant(client: httpx.Client, sandbox: SandboxServer) -> None:
    a = post(client, "k-shared", Authorization="Bearer sk_tenant_a")
    b = post(client, "k-shared", Authorization="Bearer sk_tenant_b")
    assert a.json()["id"] != b.json()["id"]
    assert {e["tenant"] for e in sandbox.effects()} == {"sk_tenant_a", "sk_tenant_b"}
    # Lookups are tenant-scoped as well.
    found = client.get(
        "/v1/refunds", params={"idempotency_key": "k-shared"}, headers={"Authorization": "Bearer sk_tenant_a"}
    )
    assert found.json()["id"] == a.json()["id"]
    assert client.get("/v1/refunds", params={"idempotency_key": "k-shared"}).status_code == 404


def test_concurrent_same_key_creates_one_object(sandbox: SandboxServer) -> None:
    # Every request of the key is slow once it holds the key, so whichever wins it stays in flight
    # for 1 s and the others get 409 key_in_use (refused before the wait). With count=1 the fault went
    # to the first request to *arrive*, but the sandbox reads the body between picking the fault and
    # taking the key: on a loaded CI machine another request once took the key first, ran without
    # the wait, and all seven others were replays (no 409).
    sandbox.add_fault(mode="latency", latency_ms=1000, key_pattern="k-race")
    n = 8
    barrier = threading.Barrier(n)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def call() -> None:
        with httpx.Client(base_url=sandbox.url, timeout=5.0) as c:
            barrier.wait()
            r = post(c, "k-race")
            with lock:
                results.append(r)

    threads = [threading.Thread(target=call) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sandbox.effects()) == 1
    created = [r for r in results if r.status_code == 200 and "Idempotent-Replayed" not in r.headers]
    assert len(created) == 1
    for r in results:
        if r is not created[0]:
            assert (
                r.status_code == 409
                and r.json()["error"]["code"] == "key_in_use"
                or (r.status_code == 200 and r.content == created[0].content)
            )
    assert any(r.status_code == 409 for r in results)


def test_retention_expiry_creates_a_second_object(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.configure(retention_s=60)
    first = post(client, "k-ret").json()
    assert post(client, "k-ret").json()["id"] == first["id"]
    sandbox.advance_clock(59)
    assert post(client, "k-ret").json()["id"] == first["id"]  # still kept a second before
    sandbox.advance_clock(1.5)
    second = post(client, "k-ret").json()
    assert second["id"] != first["id"]
    assert len(sandbox.effects(key="k-ret")) == 2
    assert sandbox.duplicates()[0]["count"] == 2


def test_retention_expiry_with_the_admin_clock(client: httpx.Client, sandbox: SandboxServer) -> None:
    first = post(client, "k-clock").json()
    sandbox.advance_clock(86400)  # Stripe's 24 h, without waiting
    assert post(client, "k-clock").json()["id"] != first["id"]


def test_index_lag_hides_new_objects_from_lookups(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.configure(index_lag_s=60)
    created = post(client, "k-lag").json()
    assert client.get("/v1/refunds", params={"idempotency_key": "k-lag"}).status_code == 404
    assert client.get("/v1/refunds").json()["data"] == []
    sandbox.advance_clock(59)
    assert client.get("/v1/refunds", params={"idempotency_key": "k-lag"}).status_code == 404
    assert client.get(f"/v1/refunds/{created['id']}").status_code == 404
    sandbox.advance_clock(1.5)
    assert client.get("/v1/refunds", params={"idempotency_key": "k-lag"}).json()["id"] == created["id"]
    assert client.get(f"/v1/refunds/{created['id']}").json()["id"] == created["id"]


def test_lookup_miss_is_404_with_stripe_error(client: httpx.Client) -> None:
    r = client.get("/v1/tickets", params={"idempotency_key": "never"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "resource_missing"


def test_listing_pages_forward_from_created_after(client: httpx.Client) -> None:
    ids = [post(client, f"k-list-{i}", {**REFUND, "order_id": f"o{i}"}).json()["id"] for i in range(5)]
    first = client.get("/v1/refunds", params={"limit": 2}).json()
    assert [o["id"] for o in first["data"]] == ids[:2] and first["has_more"] is True
    rest = client.get("/v1/refunds", params={"limit": 10, "starting_after": ids[1]}).json()
    assert [o["id"] for o in rest["data"]] == ids[2:] and rest["has_more"] is False
    created_2 = client.get(f"/v1/refunds/{ids[2]}").json()["created"]
    after = client.get("/v1/refunds", params={"created_after": created_2}).json()
    assert [o["id"] for o in after["data"]] == ids[3:]


def test_strict_fencing_refuses_a_stale_token(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.configure(strict_fencing=True)
    # The successor (token 2) reaches the provider first; its first body fails validation...
    assert post(client, "k-fence", {**REFUND, "amount": "x"}, X_Fencing_Token="2").status_code == 422
    # ...so the zombie (token 1) is refused even though nothing was created yet.
    zombie = post(client, "k-fence", X_Fencing_Token="1")
    assert zombie.status_code == 409 and zombie.json()["error"]["code"] == "stale_token"
    assert post(client, "k-fence", X_Fencing_Token="2").status_code == 200
    assert post(client, "k-fence", X_Fencing_Token="3").headers["Idempotent-Replayed"] == "true"
    assert post(client, "k-fence", X_Fencing_Token="2").json()["error"]["code"] == "stale_token"
    assert [e["fencing_token"] for e in sandbox.effects()] == [2]


def test_without_strict_fencing_tokens_are_only_recorded(client: httpx.Client, sandbox: SandboxServer) -> None:
    post(client, "k-nf", X_Fencing_Token="5")
    assert post(client, "k-nf", X_Fencing_Token="1").status_code == 200
    assert sandbox.requests(key="k-nf")[1]["fencing_token"] == "1"


def test_no_idempotency_mode_creates_duplicates(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.configure(idempotency=False)
    ids = {post(client, "k-dup").json()["id"] for _ in range(3)}
    assert len(ids) == 3
    dups = sandbox.duplicates()
    assert len(dups) == 1 and dups[0]["count"] == 3 and dups[0]["business_key"] == "k-dup"
    assert sandbox.duplicates(by="params")[0]["count"] == 3


def test_validation_422_and_over_limit_402(client: httpx.Client, sandbox: SandboxServer) -> None:
    for amount in ("0", "-1", "1.234", "abc", "1e3", 12.5):
        r = post(client, f"k-bad-{amount}", {**REFUND, "amount": amount})
        assert r.status_code == 422, amount
        assert r.json()["error"] == {
            **r.json()["error"],
            "type": "invalid_request_error",
            "code": "invalid_amount",
            "param": "amount",
        }
    assert post(client, "k-missing", {"amount": "1", "currency": "eur"}).json()["error"]["param"] == "order_id"
    assert post(client, "k-over", {**REFUND, "amount": "10000.01"}).status_code == 402
    assert post(client, "k-limit", {**REFUND, "amount": "10000.00"}).status_code == 200
    sandbox.configure(over_limit_amount="100")
    assert post(client, "k-over2", {**REFUND, "amount": "100.01"}).status_code == 402
    assert len(sandbox.effects()) == 1


def test_422_is_not_stored_but_402_is(client: httpx.Client, sandbox: SandboxServer) -> None:
    # A validation failure leaves the key free (Stripe does not save it); a fixed body then works.
    assert post(client, "k-fix", {**REFUND, "amount": "x"}).status_code == 422
    assert post(client, "k-fix", {**REFUND, "amount": "x"}).status_code == 422
    # A 402 is a decision the endpoint took: saved and replayed.
    first = post(client, "k-402", {**REFUND, "amount": "20000"})
    sandbox.configure(over_limit_amount="50000")
    again = post(client, "k-402", {**REFUND, "amount": "20000"})
    assert again.status_code == 402 and again.content == first.content
    assert again.headers["Idempotent-Replayed"] == "true"


def test_processing_objects_are_pending_then_settle(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.configure(processing_s=60)
    created = post(client, "k-proc").json()
    assert created["status"] == "pending"
    assert client.get("/v1/refunds", params={"idempotency_key": "k-proc"}).json()["status"] == "pending"
    sandbox.advance_clock(59)
    assert client.get(f"/v1/refunds/{created['id']}").json()["status"] == "pending"
    sandbox.advance_clock(1.5)
    assert client.get("/v1/refunds", params={"idempotency_key": "k-proc"}).json()["status"] == "succeeded"


def test_request_log_and_filters(client: httpx.Client, sandbox: SandboxServer) -> None:
    post(client, "k-log-a", Authorization="Bearer sk_x", X_Fencing_Token="4")
    post(client, "k-log-b")
    client.get("/v1/refunds", params={"idempotency_key": "k-log-a"}, headers={"Authorization": "Bearer sk_x"})
    rows = sandbox.requests(key="k-log-a")
    assert [(r["method"], r["status"]) for r in rows] == [("POST", 200), ("GET", 200)]
    assert rows[0]["tenant"] == "sk_x" and rows[0]["fencing_token"] == "4"
    assert rows[0]["seq"] < rows[1]["seq"] and rows[0]["time"] <= rows[1]["time"]
    assert rows[1]["query"] == "idempotency_key=k-log-a"
    assert len(sandbox.requests(path="/v1/refunds", method="POST")) == 2
    assert len(sandbox.requests(since_seq=rows[0]["seq"])) == 2
    sandbox.reset()
    assert sandbox.requests() == [] and sandbox.effects() == []


def test_config_validation_and_reset(sandbox: SandboxServer) -> None:
    assert sandbox.configure(retention_s=5)["retention_s"] == 5.0
    with httpx.Client(base_url=sandbox.url) as c:
        r = c.post("/admin/config", json={"retention": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "retention"
        assert c.post("/admin/config", json={"strict_fencing": "yes"}).json()["error"]["param"] == "strict_fencing"
    sandbox.reset()
    assert sandbox.config()["retention_s"] == 86400.0


def test_sandbox_process_from_the_command_line() -> None:
    with SandboxProcess("--no-idempotency", "--fault", '{"mode": "unavailable_503", "count": 1}') as proc:
        with httpx.Client(base_url=proc.url, timeout=5.0) as c:
            assert post(c, "k").status_code == 503
            assert post(c, "k").status_code == 200 and post(c, "k").status_code == 200
        assert proc.config()["idempotency"] is False
        assert len(proc.duplicates()) == 1
