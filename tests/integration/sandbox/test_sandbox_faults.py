"""Each sandbox fault mode does exactly what it claims, checked over real HTTP and in the ledger."""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from workers.sandbox.faults import MODES
from workers.sandbox.testing import SandboxServer

REFUND = {"order_id": "ord-9", "amount": "40.00", "currency": "usd", "reason": "requested_by_customer"}


# `sandbox` (tests/conftest.py): one SandboxServer for the session, reset before each test.


@pytest.fixture
def client(sandbox: SandboxServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox.url, timeout=2.0) as c:
        yield c


def post(client: httpx.Client, key: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    return client.post("/v1/refunds", json=body or REFUND, headers={"Idempotency-Key": key}, **kw)


def lookup(client: httpx.Client, key: str) -> httpx.Response:
    return client.get("/v1/refunds", params={"idempotency_key": key})


def test_commit_then_drop_client_sees_reset_object_exists(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", count=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        post(client, "k-drop")
    effects = sandbox.effects(key="k-drop")
    assert len(effects) == 1
    assert lookup(client, "k-drop").json()["id"] == effects[0]["object_id"]
    # A retry with the same key replays the committed response; still one effect.
    retry = post(client, "k-drop")
    assert retry.headers["Idempotent-Replayed"] == "true" and retry.json()["id"] == effects[0]["object_id"]
    assert len(sandbox.effects()) == 1
    assert sandbox.requests(key="k-drop")[0]["status"] == "reset"


def test_commit_then_stall_times_out_the_client_object_exists(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="commit_then_stall", stall_s=1.0, count=1)
    with pytest.raises(httpx.ReadTimeout):
        post(client, "k-stall", timeout=0.3)
    assert len(sandbox.effects(key="k-stall")) == 1
    assert sandbox.requests(key="k-stall")[0]["status"] == "stalled"
    # The key was completed at commit, so a retry during the stall replays instead of 409.
    assert post(client, "k-stall").headers["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("mode,status", [("commit_then_500", 500), ("commit_then_502", 502), ("commit_then_504", 504)])
def test_commit_then_5xx(client: httpx.Client, sandbox: SandboxServer, mode: str, status: int) -> None:
    sandbox.add_fault(mode=mode, count=1)
    r = post(client, f"k-{mode}")
    assert r.status_code == status and "error" in r.json()
    assert len(sandbox.effects()) == 1
    assert post(client, f"k-{mode}").status_code == 200  # the stored response is the real one


def test_commit_then_error_with_chosen_status(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="commit_then_error", status=503, count=1)
    assert post(client, "k-ce").status_code == 503
    assert len(sandbox.effects()) == 1


def test_fail_before_commit_creates_nothing_and_frees_the_key(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="fail_before_commit", count=1)
    r = post(client, "k-500")
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    assert sandbox.effects() == []
    assert lookup(client, "k-500").status_code == 404  # provably not executed
    retry = post(client, "k-500")
    assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers
    assert len(sandbox.effects()) == 1


@pytest.mark.parametrize("http_date", [False, True])
def test_503_and_429_with_retry_after(client: httpx.Client, sandbox: SandboxServer, http_date: bool) -> None:
    sandbox.add_fault(mode="unavailable_503", retry_after_s=2, retry_after_http_date=http_date, count=1)
    sandbox.add_fault(mode="rate_limited_429", retry_after_s=3, retry_after_http_date=http_date, count=1)
    r503, r429 = post(client, "k-a"), post(client, "k-b")
    assert (r503.status_code, r429.status_code) == (503, 429)
    for response, delay in ((r503, 2), (r429, 3)):
        value = response.headers["Retry-After"]
        if http_date:
            when = email.utils.parsedate_to_datetime(value).timestamp()
            assert delay - 0.5 <= when - time.time() <= delay + 1  # whole seconds, rounded up
        else:
            assert value == str(delay)
    assert sandbox.effects() == []
    assert post(client, "k-a").status_code == 200  # nothing processed: the key is free


def test_429_defaults_to_retry_after_one_second(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="rate_limited_429", count=1)
    assert post(client, "k").headers["Retry-After"] == "1"


def test_truncated_body_is_unparseable_and_object_exists(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="truncated_body", count=1)
    r = post(client, "k-trunc")
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        r.json()
    assert len(sandbox.effects(key="k-trunc")) == 1


@pytest.mark.parametrize("mode", ["malformed_body", "empty_body"])
def test_malformed_and_empty_2xx(client: httpx.Client, sandbox: SandboxServer, mode: str) -> None:
    sandbox.add_fault(mode=mode, count=1)
    r = post(client, "k-m")
    assert r.status_code == 200
    with pytest.raises(json.JSONDecodeError):
        r.json()
    assert len(sandbox.effects()) == 1


def test_commit_then_partial_is_an_incomplete_body(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="commit_then_partial", count=1)
    with pytest.raises(httpx.RemoteProtocolError):
        post(client, "k-part")
    assert len(sandbox.effects()) == 1


@pytest.mark.parametrize("mode", ["drop_before_commit", "refuse"])
def test_drop_before_commit(client: httpx.Client, sandbox: SandboxServer, mode: str) -> None:
    sandbox.add_fault(mode=mode, count=1)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        post(client, "k-refuse")
    assert sandbox.effects() == []
    assert post(client, "k-refuse").status_code == 200


def test_stall_before_commit(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="stall_before_commit", stall_s=0.5, count=1)
    with pytest.raises(httpx.ReadTimeout):
        post(client, "k-bh", timeout=0.2)
    assert sandbox.effects() == []


def test_latency(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="latency", latency_ms=150, count=1)
    started = time.monotonic()
    assert post(client, "k-lat").status_code == 200
    assert time.monotonic() - started >= 0.15


@pytest.mark.parametrize(
    "mode,status,code", [("reject_422", 422, "invalid_amount"), ("reject_402", 402, "amount_over_limit")]
)
def test_business_rejections(client: httpx.Client, sandbox: SandboxServer, mode: str, status: int, code: str) -> None:
    sandbox.add_fault(mode=mode, count=1)
    r = post(client, "k-rej")
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert sandbox.effects() == []


def test_lookup_endpoint_down_then_recovered(client: httpx.Client, sandbox: SandboxServer) -> None:
    post(client, "k-look")
    rule = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    sandbox.add_fault(mode="fail_before_commit", method="GET", path="/v1/tickets")
    assert lookup(client, "k-look").status_code == 503
    assert client.get("/v1/tickets", params={"idempotency_key": "x"}).status_code == 500
    assert post(client, "k-look2").status_code == 200  # only lookups are down
    sandbox.remove_fault(rule["id"])
    assert lookup(client, "k-look").status_code == 200


def test_downstream_down_for_breaker_tests(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="unavailable_503", path="/v1/*")
    assert [post(client, f"k{i}").status_code for i in range(3)] == [503, 503, 503]
    sandbox.clear_faults()
    assert post(client, "k0").status_code == 200
    assert [r["status"] for r in sandbox.requests(path="/v1/refunds")] == [503, 503, 503, 200]


def test_count_rule_stops_after_n(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="fail_before_commit", count=2)
    assert [post(client, "k-count").status_code for _ in range(4)] == [500, 500, 200, 200]
    (rule,) = sandbox.faults()
    assert rule["fired"] == 2 and rule["exhausted"] is True


def test_probability_rule_with_seed_is_reproducible(client: httpx.Client, sandbox: SandboxServer) -> None:
    def run() -> list[int]:
        sandbox.reset()
        sandbox.add_fault(mode="fail_before_commit", probability=0.5, seed=7)
        return [post(client, f"k-p{i}").status_code for i in range(20)]

    first, second = run(), run()
    assert first == second
    assert 0 < first.count(500) < 20


def test_key_pattern_glob_and_regex_and_rule_order(client: httpx.Client, sandbox: SandboxServer) -> None:
    sandbox.add_fault(mode="reject_402", key_pattern="vip-*")
    sandbox.add_fault(mode="unavailable_503", key_pattern="re:^wf-\\d+$")
    sandbox.add_fault(mode="fail_before_commit")  # catches the rest
    assert post(client, "vip-1").status_code == 402
    assert post(client, "wf-12").status_code == 503
    assert post(client, "wf-x").status_code == 500
    assert [r["fired"] for r in sandbox.faults()] == [1, 1, 1]
    assert [r["fault"] for r in sandbox.requests()] == ["reject_402", "unavailable_503", "fail_before_commit"]


def test_scripted_per_request_header(client: httpx.Client, sandbox: SandboxServer) -> None:
    r = client.post(
        "/v1/refunds", json=REFUND, headers={"X-Sandbox-Fault": '{"mode": "commit_then_error", "status": 504}'}
    )
    assert r.status_code == 504 and len(sandbox.effects()) == 1


def test_rule_validation_names_the_field(sandbox: SandboxServer) -> None:
    with httpx.Client(base_url=sandbox.url) as c:
        for body, field in (
            ({"mode": "explode"}, "mode"),
            ({"mode": "latency", "latncy_ms": 3}, "latncy_ms"),
            ({"mode": "latency", "probability": 2}, "probability"),
            ({"mode": "latency", "count": "two"}, "count"),
            ({"mode": "latency", "key_pattern": "re:("}, "key_pattern"),
            ({"path": "/v1/refunds"}, "mode"),
        ):
            r = c.post("/admin/faults", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, body
        assert c.delete("/admin/faults/999").status_code == 404
    assert sandbox.faults() == []


def test_retry_after_is_honoured_check_via_request_log(client: httpx.Client, sandbox: SandboxServer) -> None:
    # The client "waits" Retry-After by moving the sandbox's clock: clock_time shows the wait,
    # the real time did not pass.
    sandbox.add_fault(mode="rate_limited_429", retry_after_s=30, count=1)
    first = post(client, "k-ra")
    sandbox.advance_clock(float(first.headers["Retry-After"]))
    post(client, "k-ra")
    a, b = sandbox.requests(key="k-ra")
    assert (a["status"], b["status"]) == (429, 200)
    assert b["clock_time"] - a["clock_time"] >= 30.0 and b["time"] - a["time"] < 30.0
    # An impatient client is just as visible.
    sandbox.add_fault(mode="rate_limited_429", retry_after_s=30, count=1)
    post(client, "k-impatient")
    post(client, "k-impatient")
    c, d = sandbox.requests(key="k-impatient")
    assert (c["status"], d["status"]) == (429, 200) and d["clock_time"] - c["clock_time"] < 30.0


def test_every_mode_is_documented() -> None:
    readme = open(
        __file__.replace("tests/integration/sandbox/test_sandbox_faults.py", "workers/sandbox/README.md")
    ).read()
    for mode in MODES:
        assert f"`{mode}`" in readme, mode
