"""The HTTP API's request counts and latencies (``outbox_http_requests_total``,
``outbox_http_request_duration_seconds``), labelled by method, the route's template and status,
served on the API's own ``/metrics``.

The route is read after routing (Starlette and FastAPI put the matched route in the request's
scope), so ``/v1/operations/{operation_id}`` is one series whatever the id; a path no route
matches is ``unmatched``. The time runs to the response's last byte: a long-poll (``wait_s``) is
as long as it was.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from workers.ground import metrics

UNMATCHED = "unmatched"


def route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED


class RequestMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before any response start: the server answers 500

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            metrics.record_http_request(scope["method"], route_of(scope), status, time.perf_counter() - started)
