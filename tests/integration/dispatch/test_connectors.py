"""HttpConnector against a real local HTTP server: each failure mode is classified by the table,
and the key, fencing token and path placeholders arrive as declared."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from outbox.ledger.states import AttemptClass
from workers.provider.actions import ActionsFile, parse_actions
from workers.provider.connectors import (
    ConnectorSet,
    HttpConnector,
    LookupNotDeclared,
    register_connector,
    unregister_connector,
)

A = AttemptClass
TIMEOUT_S = 0.3  # the stall handler sleeps past this
STALL_S = 1.0
KEY = "wf-81:invoice-17:refund-2:v1"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _reply(
        self, status: int, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None
    ) -> None:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        Handler.seen.append(
            {
                "method": self.command,
                "path": url.path,
                "query": parse_qs(url.query),
                "headers": dict(self.headers),
                "body": body,
            }
        )
        mode = url.path.split("/")[2] if url.path.count("/") >= 2 else ""
        if mode == "ok":
            self._reply(201, {"id": "re_1", "status": "succeeded"}, {"Request-Id": "req_1"})
        elif mode == "busy":
            self._reply(503, {"error": {"code": "busy"}}, {"Retry-After": "7"})
        elif mode == "throttled":
            self._reply(429, {"error": {"code": "rate_limited"}}, {"Retry-After": "Wed, 21 Oct 2099 07:28:00 GMT"})
        elif mode == "boom":
            self._reply(500, {"error": {"code": "internal"}})
        elif mode == "rejected":
            self._reply(422, {"error": {"code": "invalid_amount"}})
        elif mode == "noref":
            self._reply(200, {"status": "succeeded"})
        elif mode == "drop":
            # The provider read the whole request (and may have committed), then vanished.
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif mode == "stall":
            time.sleep(STALL_S)
            self.close_connection = True
        elif mode == "truncated":
            # Promise 200 bytes, send 20, hang up: a proxy cutting the body.
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.end_headers()
            self.wfile.write(b'{"id": "re_1", "sta')
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif mode == "halfjson":
            self._reply(200, raw=b'{"id": "re_1", "sta')
        elif mode == "lookup":
            key = parse_qs(url.query).get("idempotency_key", [""])[0]
            if key == "known":
                self._reply(200, {"data": [{"id": "re_9", "status": "pending", "idempotency_key": "known"}]})
            elif key == "down":
                self._reply(503, {"error": {"code": "busy"}})
            elif key == "gone":
                self._reply(404, {"error": {"code": "not_found"}})
            elif key == "ignored-filter":
                self._reply(200, {"data": [{"id": "re_x", "status": "succeeded", "idempotency_key": "other"}]})
            else:
                self._reply(200, {"data": []})
        else:
            self._reply(404, {"error": {"code": "no_route"}})

    do_GET = do_POST = do_PUT = _route


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.block_on_close = False  # the stall handler may still be sleeping at teardown
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(base_url: str, **action: Any) -> ActionsFile:
    base = {
        "target": "payments",
        "request": {"method": "POST", "path": "/v1/ok/{order_id}"},
        "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
        "fencing_header": "X-Fencing-Token",
        "args": ["order_id", "amount", "currency", "customer_email"],
        "decimal_args": ["amount"],
        "lookup": {
            "request": {"method": "GET", "path": "/v1/lookup", "query": {"idempotency_key": "{idempotency_key}"}},
            "authoritative_not_found": True,
            "key_field": "idempotency_key",
        },
    }
    base.update(action)
    return parse_actions(
        {
            "targets": {
                "payments": {
                    "base_url": base_url,
                    "timeout_s": TIMEOUT_S,
                    "connect_timeout_s": 0.5,
                    "headers": {"Authorization": "Bearer ${PAY_TOKEN}"},
                }
            },
            "actions": {"payments.refund.create": base},
        },
        environ={"PAY_TOKEN": "tok"},
    )


ARGS = {"order_id": "ord/7 a", "amount": "12.50", "currency": "eur", "customer_email": "a@example.com"}


def send(cfg: ActionsFile, args: dict[str, Any] = ARGS, token: int = 3):  # type: ignore[no-untyped-def]
    with HttpConnector(cfg) as conn:
        return conn.send(
            "payments.refund.create",
            cfg.action("payments.refund.create"),
            args=args,
            idempotency_key=KEY,
            fencing_token=token,
        )


def test_success_carries_key_token_and_placeholders(server: str) -> None:
    Handler.seen.clear()
    result = send(config(server))
    assert result.classification.klass is A.SUCCEEDED
    assert result.classification.provider_reference == "re_1"
    assert result.classification.provider_request_id == "req_1"
    assert result.status_code == 201 and result.latency_s > 0 and len(result.request_digest) == 64
    req = Handler.seen[-1]
    assert req["path"] == "/v1/ok/ord%2F7%20a"  # one quoted path segment
    assert req["headers"]["Idempotency-Key"] == KEY
    assert req["headers"]["X-Fencing-Token"] == "3"
    assert req["headers"]["Authorization"] == "Bearer tok"
    # The placeholder argument is consumed; the rest is the canonical JSON body.
    assert json.loads(req["body"]) == {"amount": "12.50", "currency": "eur", "customer_email": "a@example.com"}


def test_digest_is_stable_across_attempts_and_token(server: str) -> None:
    cfg = config(server)
    assert send(cfg, token=3).request_digest == send(cfg, token=4).request_digest
    assert send(cfg, {**ARGS, "amount": "12.51"}).request_digest != send(cfg).request_digest


def test_headers_omitted_when_not_declared(server: str) -> None:
    Handler.seen.clear()
    # Without the key header a lookup by key proves nothing, so this action declares none.
    send(config(server, provider_idempotency=None, fencing_header=None, lookup=None))
    headers = Handler.seen[-1]["headers"]
    assert "Idempotency-Key" not in headers and "X-Fencing-Token" not in headers


@pytest.mark.parametrize(
    ("mode", "klass", "reason"),
    [
        ("busy", A.NOT_PROCESSED, "http_503"),
        ("throttled", A.NOT_PROCESSED, "http_429"),
        ("boom", A.AMBIGUOUS, "http_500"),
        ("rejected", A.REJECTED, "http_422"),
        ("noref", A.AMBIGUOUS, "http_200_without_id"),
        ("drop", A.AMBIGUOUS, "remote_protocol_error"),
        ("stall", A.AMBIGUOUS, "read_timeout"),
        ("truncated", A.AMBIGUOUS, "remote_protocol_error"),
        ("halfjson", A.AMBIGUOUS, "http_200_body_unparseable"),
    ],
)
def test_failure_modes(server: str, mode: str, klass: AttemptClass, reason: str) -> None:
    started = time.monotonic()
    result = send(config(server, request={"method": "POST", "path": f"/v1/{mode}/{{order_id}}"}))
    assert result.classification.klass is klass, result
    assert result.classification.reason == reason
    assert result.raw_error
    assert time.monotonic() - started < STALL_S  # the client timeout, not the server, ended it


def test_retry_after_from_real_response(server: str) -> None:
    result = send(config(server, request={"method": "POST", "path": "/v1/busy/{order_id}"}))
    assert result.classification.retry_after_s == 7.0
    result = send(config(server, request={"method": "POST", "path": "/v1/throttled/{order_id}"}))
    # A date in 2099: the provider's word, never cut to an hour (the budget's deadline decides, issue 15).
    assert result.classification.retry_after_s is not None and result.classification.retry_after_s > 2e9


def test_connection_refused_is_not_sent() -> None:
    result = send(config(f"http://127.0.0.1:{closed_port()}"))
    assert result.classification.klass is A.NOT_SENT
    assert result.classification.reason == "connect_error"
    assert "ConnectError" in (result.raw_error or "")


@pytest.mark.parametrize("amount", [12.5, "12,50", True, [12]])
def test_money_must_be_decimal_string(server: str, amount: object) -> None:
    Handler.seen.clear()
    result = send(config(server), {**ARGS, "amount": amount})
    assert result.classification.klass is A.NOT_SENT
    assert result.classification.origin == "local"
    assert Handler.seen == []  # nothing left the machine


def test_decimal_value_is_sent_as_string(server: str) -> None:
    Handler.seen.clear()
    assert send(config(server), {**ARGS, "amount": Decimal("12.50")}).classification.klass is A.SUCCEEDED
    assert json.loads(Handler.seen[-1]["body"])["amount"] == "12.50"


def test_a_whole_amount_is_sent_as_its_decimal_string(server: str) -> None:
    """Decimal("12.00") is stored as 12 (the ledger canonicalises numbers by value): it is money."""
    Handler.seen.clear()
    assert send(config(server), {**ARGS, "amount": 12}).classification.klass is A.SUCCEEDED
    assert json.loads(Handler.seen[-1]["body"])["amount"] == "12"


def test_missing_placeholder_argument_is_not_sent(server: str) -> None:
    result = send(config(server), {"amount": "1.00"})
    assert result.classification.klass is A.NOT_SENT and "order_id" in result.classification.reason


def test_get_sends_rest_as_query(server: str) -> None:
    Handler.seen.clear()
    send(config(server, request={"method": "GET", "path": "/v1/ok/{order_id}"}))
    assert Handler.seen[-1]["query"] == {"amount": ["12.50"], "currency": ["eur"], "customer_email": ["a@example.com"]}


@pytest.mark.parametrize(
    ("key", "outcome", "state"),
    [
        ("known", "found", "pending"),
        ("nothing", "not_found", None),
        ("gone", "not_found", None),
        ("down", "unavailable", None),
        ("ignored-filter", "not_found", None),  # someone else's object is not evidence of ours
    ],
)
def test_lookup(server: str, key: str, outcome: str, state: str | None) -> None:
    cfg = config(server)
    Handler.seen.clear()
    with HttpConnector(cfg) as conn:
        result = conn.lookup(
            "payments.refund.create", cfg.action("payments.refund.create"), args=ARGS, idempotency_key=key
        )
    assert (result.outcome, result.state) == (outcome, state)
    assert Handler.seen[-1]["query"] == {"idempotency_key": [key]}
    assert Handler.seen[-1]["body"] == b""  # a lookup sends only its templated fields
    if outcome == "found":
        assert result.provider_reference == "re_9" and result.obj is not None


def test_lookup_transport_error_is_unavailable() -> None:
    cfg = config(f"http://127.0.0.1:{closed_port()}")
    with HttpConnector(cfg) as conn:
        result = conn.lookup(
            "payments.refund.create", cfg.action("payments.refund.create"), args={}, idempotency_key="k"
        )
    assert result.outcome == "unavailable" and result.reason == "connect_error"


def test_lookup_not_declared(server: str) -> None:
    cfg = config(server, lookup=None)
    with HttpConnector(cfg) as conn, pytest.raises(LookupNotDeclared):
        conn.lookup("payments.refund.create", cfg.action("payments.refund.create"), args={}, idempotency_key="k")


def test_one_pooled_client_per_target_closed_on_close(server: str) -> None:
    cfg = config(server)
    conn = HttpConnector(cfg)
    client = conn.client_for("payments")
    assert conn.client_for("payments") is client
    conn.close()
    assert client.is_closed


class FakeConnector:
    def __init__(self, cfg: ActionsFile) -> None:
        self.cfg, self.closed = cfg, False

    def send(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def lookup(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True


def make_fake(cfg: ActionsFile) -> FakeConnector:
    return FakeConnector(cfg)


def test_python_hook_connectors(server: str) -> None:
    by_ref = config(server, connector=f"{__name__}:make_fake")
    connectors = ConnectorSet(by_ref)
    assert isinstance(connectors.for_action("payments.refund.create"), FakeConnector)
    connectors.close()

    register_connector("payments.refund.create", make_fake)
    try:
        connectors = ConnectorSet(config(server))
        assert isinstance(connectors.for_action("payments.refund.create"), FakeConnector)
    finally:
        unregister_connector("payments.refund.create")
    assert isinstance(ConnectorSet(config(server)).for_action("payments.refund.create"), HttpConnector)

    from outbox.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot load connector"):
        ConnectorSet(config(server, connector="no_such_module_xyz:factory"))
