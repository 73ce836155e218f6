"""``AsyncOutboxClient``: ``OutboxClient`` for asyncio (FastAPI handlers, async agent runtimes).

::

    async with AsyncOutboxClient("http://outbox:8800", api_key) as outbox:
        op = await outbox.submit("support.ticket.create", {"subject": "..."}, idempotency_key="t-81:v1")
        op = await outbox.wait(op.operation_id, timeout_s=30)

The same calls, answers, exceptions and retries as the sync client (client.py); only the I/O differs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import tenacity

from outbox.service.waiting import MAX_WAIT_S
from producer.remote import calls
from producer.remote.client import answered, headers_for, request_of
from producer.remote.models import Approval, BatchItem, Handoff, Operation, Page, PendingApproval, Run
from producer.remote.retries import RetryPolicy, unreachable

T = TypeVar("T")


class AsyncOutboxClient:
    """As OutboxClient; ``http``: an httpx.AsyncClient of your own (then yours to close)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        http: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._owned = http is None
        self.http = http if http is not None else httpx.AsyncClient()
        self._headers = headers_for(api_key, headers)

    # -- agents -----------------------------------------------------------------------------
    async def submit(
        self,
        action: str,
        args: Mapping[str, Any],
        *,
        idempotency_key: str,
        subject: str | None = None,
        run_id: str | None = None,
        tool_call_id: str | None = None,
        max_attempts: int | None = None,
        deadline_s: float | None = None,
        priority: int | None = None,
        budget_scope: str | None = None,
    ) -> Operation:
        """As OutboxClient.submit."""
        body = calls.intent_body(
            action,
            args,
            idempotency_key,
            subject=subject,
            run_id=run_id,
            tool_call_id=tool_call_id,
            max_attempts=max_attempts,
            deadline_s=deadline_s,
            priority=priority,
        )
        return await self._send(calls.submit(body, budget_scope))

    async def submit_batch(self, intents: Sequence[Mapping[str, Any]]) -> list[BatchItem]:
        return await self._send(calls.submit_batch(calls.batch_bodies(intents)))

    async def get(self, operation_id: str) -> Operation:
        return await self._send(calls.get(operation_id))

    async def wait(self, operation_id: str, timeout_s: float | None = 30.0) -> Operation:
        """As OutboxClient.wait: until settled or ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
            op = await self._send(calls.wait(operation_id, round(min(left, MAX_WAIT_S), 3)))
            if op.settled or (deadline is not None and time.monotonic() >= deadline):
                return op

    async def cancel(self, operation_id: str) -> Operation:
        return await self._send(calls.cancel(operation_id))

    async def operations(
        self,
        *,
        status: str | None = None,
        action: str | None = None,
        idempotency_key: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page:
        return await self._send(
            calls.operations(status=status, action=action, idempotency_key=idempotency_key, limit=limit, cursor=cursor)
        )

    async def iter_operations(
        self,
        *,
        page_size: int = 100,
        status: str | None = None,
        action: str | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[Operation]:
        cursor: str | None = None
        while True:
            page = await self.operations(
                status=status, action=action, idempotency_key=idempotency_key, limit=page_size, cursor=cursor
            )
            for op in page.operations:
                yield op
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def submit_run(
        self,
        run_key: str,
        steps: Sequence[Mapping[str, Any]],
        *,
        budget: Mapping[str, Any] | None = None,
        subject: str | None = None,
        priority: int | None = None,
    ) -> Run:
        return await self._send(calls.submit_run(run_key, steps, budget=budget, subject=subject, priority=priority))

    async def get_run(self, run_id: str) -> Run:
        return await self._send(calls.get_run(run_id))

    async def cancel_run(self, run_id: str, *, compensate: bool = False) -> Run:
        return await self._send(calls.cancel_run(run_id, compensate=compensate))

    # -- operators --------------------------------------------------------------------------
    async def approvals(self) -> list[PendingApproval]:
        return await self._send(calls.approvals())

    async def approve(self, operation_id: str, *, by: str, note: str | None = None) -> Approval:
        return await self._send(calls.decide(operation_id, approve=True, by=by, note=note))

    async def deny(self, operation_id: str, *, by: str, note: str) -> Approval:
        return await self._send(calls.decide(operation_id, approve=False, by=by, note=note))

    async def handoffs(self, *, include_resolved: bool = False) -> list[Handoff]:
        return await self._send(calls.handoffs(include_resolved=include_resolved))

    async def handoff(self, handoff_id: int) -> Handoff:
        return await self._send(calls.handoff(handoff_id))

    async def resolve_handoff(
        self, handoff_id: int, *, resolution: str, note: str, by: str, reference: str | None = None
    ) -> Handoff:
        return await self._send(
            calls.resolve_handoff(handoff_id, resolution=resolution, note=note, by=by, reference=reference)
        )

    # -- the wire ---------------------------------------------------------------------------
    async def _send(self, call: calls.Call[T]) -> T:
        retrying = tenacity.AsyncRetrying(**self.retry.tenacity_kwargs(call.replay_safe))
        response: httpx.Response = await retrying(self._once, call)
        return call.read(response)

    async def _once(self, call: calls.Call[Any]) -> httpx.Response:
        asked = request_of(call, self.base_url, self._headers, self.timeout_s)
        try:
            response = await self.http.request(**asked)
        except (httpx.LocalProtocolError, httpx.UnsupportedProtocol):
            raise  # could not be sent as asked (a bad header, a bad URL): sending again changes nothing
        except httpx.TransportError as exc:
            raise unreachable(call.method, asked["url"], exc, call.idempotency_key) from exc
        return answered(response)

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    async def __aenter__(self) -> AsyncOutboxClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
