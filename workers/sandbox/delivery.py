"""What the client receives: the provider's reply, or that reply lost, delayed or garbled.

Before-commit faults answer without processing anything; after-commit faults take the reply to a
request that was executed (the object exists) and drop, stall or corrupt it on the way back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from workers.sandbox.faults import AFTER_COMMIT, FaultRule
from workers.sandbox.requestlog import RequestEntry
from workers.sandbox.responses import encode, error_body, retry_after_value

JSON = "application/json"


@dataclass
class Reply:
    """What the provider decided, before after-commit faults decide what the client receives."""

    status: int
    body: bytes
    request_id: str
    replayed_from: str | None = None  # the original Request-Id on an idempotent replay
    object_id: str | None = None
    headers: dict[str, str] | None = None


def error(status: int, rid: str, type_: str, code: str, message: str, param: str | None = None) -> Reply:
    return Reply(status, encode(error_body(type_, code, message, param)), rid)


def respond(reply: Reply, status: int | None = None, body: bytes | None = None) -> web.Response:
    headers = {"Request-Id": reply.request_id}
    if reply.replayed_from is not None:
        # Stripe marks replays with these two headers; the body itself is the stored bytes.
        headers["Idempotent-Replayed"] = "true"
        headers["Original-Request"] = reply.replayed_from
    if reply.headers:
        headers.update(reply.headers)
    return web.Response(
        status=status if status is not None else reply.status,
        body=reply.body if body is None else body,
        headers=headers,
        content_type=JSON,
    )


def drop(request: web.Request, entry: RequestEntry) -> web.Response:
    """Reset the TCP connection (RST via abort), so the client sees a reset, not a response."""
    entry.status = "reset"
    transport = request.transport
    if transport is not None:
        transport.abort()
    # aiohttp finds the transport closed and skips writing this response.
    return web.Response(status=500)


async def fail_before_commit(
    request: web.Request, entry: RequestEntry, rule: FaultRule, rid: str
) -> web.StreamResponse:
    """Faults that happen before the provider did anything: provably not executed."""
    if rule.latency_ms:
        await asyncio.sleep(rule.latency_ms / 1000)
    mode = rule.mode
    if mode in ("drop_before_commit", "refuse"):
        return drop(request, entry)
    if mode == "stall_before_commit":
        entry.status = "stalled"
        await asyncio.sleep(rule.stall_s)
        return drop(request, entry)
    headers: dict[str, str] = {}
    if mode == "unavailable_503":
        status, code = 503, "service_unavailable"
        if rule.retry_after_s is not None:
            headers["Retry-After"] = retry_after_value(rule.retry_after_s, rule.retry_after_http_date)
    elif mode == "rate_limited_429":
        status, code = 429, "rate_limit"
        seconds = rule.retry_after_s if rule.retry_after_s is not None else 1.0
        headers["Retry-After"] = retry_after_value(seconds, rule.retry_after_http_date)
    elif mode == "refuse_credentials":
        # Stripe's words: 401 authentication_error (no valid key), 403 permission_error (the key lacks it).
        status = rule.status or 401
        code = "invalid_api_key" if status == 401 else "permission_denied"
    else:  # fail_before_commit
        status, code = rule.status or 500, "api_error"
    type_ = {429: "rate_limit_error", 401: "authentication_error", 403: "permission_error"}.get(status, "api_error")
    reply = error(status, rid, type_, code, f"Injected {mode}: nothing was processed.")
    reply.headers = headers
    entry.status = status
    return respond(reply)


_GATEWAY_CODES = {500: "api_error", 502: "bad_gateway", 504: "gateway_timeout"}


async def deliver(
    request: web.Request, entry: RequestEntry, rule: FaultRule | None, reply: Reply
) -> web.StreamResponse:
    """Send the reply, or lose/delay/garble it if an after-commit fault fired."""
    entry.object_id = reply.object_id
    entry.replayed = reply.replayed_from is not None
    mode = rule.mode if rule is not None else None
    if mode is None or mode not in AFTER_COMMIT:
        entry.status = reply.status
        return respond(reply)
    assert rule is not None
    if mode == "commit_then_drop":
        return drop(request, entry)
    if mode == "commit_then_stall":
        entry.status = "stalled"
        await asyncio.sleep(rule.stall_s)
        return respond(reply)  # usually nobody is listening any more
    if mode in ("commit_then_500", "commit_then_502", "commit_then_504", "commit_then_error"):
        status = int(mode[-3:]) if mode[-3:].isdigit() else (rule.status or 502)
        entry.status = status
        code = _GATEWAY_CODES.get(status, "api_error")
        return respond(error(status, reply.request_id, "api_error", code, f"Injected {mode}."))
    entry.status = reply.status
    if mode == "truncated_body":
        return respond(reply, body=reply.body[: len(reply.body) // 2])
    if mode == "malformed_body":
        return respond(reply, body=b"<html><body><h1>502 Bad Gateway</h1></body></html>")
    if mode == "empty_body":
        return respond(reply, body=b"")
    # commit_then_partial: promise the whole body, send half, then reset.
    stream = web.StreamResponse(status=reply.status, headers={"Request-Id": reply.request_id})
    stream.content_type = JSON
    stream.content_length = len(reply.body)
    await stream.prepare(request)
    await stream.write(reply.body[: len(reply.body) // 2])
    drop(request, entry)
    return stream
