"""``OutboxClient``: the HTTP API from a Python process that does not share the outbox's database.

::

    from producer.remote import OutboxClient, IdempotencyConflict

    with OutboxClient("http://outbox:8800", api_key) as outbox:
        op = outbox.submit("payments.refund.create", {"order_id": "o-17", "amount": Decimal("25.00")},
                           idempotency_key="wf-81:invoice-17:refund-2:v1")
        op = outbox.wait(op.operation_id, timeout_s=30)
        print(op.outcome, op.model_message)

Refusals raise the ``OutboxProblem`` subclass of their problem type (problems.py); requests are sent
again only when that cannot act twice (retries.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
import tenacity

from outbox.ledger import tracing
from outbox.service.waiting import MAX_WAIT_S
from producer.remote import calls
from producer.remote.models import Approval, BatchItem, Handoff, Operation, Page, PendingApproval, Run
from producer.remote.problems import problem_of
from producer.remote.retries import CONNECT_TIMEOUT_S, RetryPolicy, retry_after_s, unreachable

T = TypeVar("T")


def headers_for(api_key: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    accept = "application/json, application/problem+json"
    return {"Authorization": f"Bearer {api_key}", "Accept": accept} | dict(extra or {})


def request_of(call: calls.Call[Any], base_url: str, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """httpx's ``request()`` arguments for one call. The caller's current trace, if it traces (the
    ``otel`` extra, producer/tracing.py), travels as W3C ``traceparent``: the intent it submits
    continues it (unless ``headers`` already name one)."""
    traced = tracing.current()
    trace = {"traceparent": traced} if traced and "traceparent" not in headers else {}
    return {
        "method": call.method,
        "url": base_url + call.path,
        "params": call.params,
        "content": call.content(),
        "headers": headers
        | dict(call.headers or {})
        | trace
        | ({"Content-Type": "application/json"} if call.body is not None else {}),
        # A long-poll's answer comes after the server's wait: the read timeout covers it.
        "timeout": httpx.Timeout(timeout_s + call.wait_s, connect=min(CONNECT_TIMEOUT_S, timeout_s)),
    }


def answered(response: httpx.Response) -> httpx.Response:
    """The response if it is a success; else its typed problem, raised."""
    if response.status_code >= 400:
        raise problem_of(response, retry_after_s=retry_after_s(response))
    return response


class OutboxClient:
    """A client of one ``agent-outbox serve``, with one API key (its tenant and scopes).

    ``timeout_s``: for each answer (a wait adds its own long-poll). ``retry``: when a request is sent
    again (RetryPolicy(attempts=1): never). ``http``: an httpx.Client of your own (proxies, TLS,
    transports); the client then leaves closing it to you. ``headers``: sent with every request."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        http: httpx.Client | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._owned = http is None
        self.http = http if http is not None else httpx.Client()
        self._headers = headers_for(api_key, headers)

    # -- agents -----------------------------------------------------------------------------
    def submit(
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
        """Submit one intent; the stored operation (``.new``: False when it was there already).
        IdempotencyConflict when the key was used with other arguments. ``budget_scope``: the conversation
        charged for it (outbox/ledger/budget_scopes.py); BudgetExhausted (a ``Refused``) when it has no room."""
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
        return self._send(calls.submit(body, budget_scope))

    def submit_batch(self, intents: Sequence[Mapping[str, Any]]) -> list[BatchItem]:
        """Up to 500 intents (each ``{action, args, idempotency_key, ...}`` as ``submit`` takes them) in
        one transaction; one item per intent, in order: its operation, or its problem."""
        return self._send(calls.submit_batch(calls.batch_bodies(intents)))

    def get(self, operation_id: str) -> Operation:
        """The operation with its attempt_log, history and typed outcome."""
        return self._send(calls.get(operation_id))

    def wait(self, operation_id: str, timeout_s: float | None = 30.0) -> Operation:
        """Long-polls until the outcome is settled (``.settled``: final, or a person or an approval is
        needed) or ``timeout_s`` passed (None: no limit); the operation as it is then."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
            op = self._send(calls.wait(operation_id, round(min(left, MAX_WAIT_S), 3)))
            if op.settled or (deadline is not None and time.monotonic() >= deadline):
                return op

    def cancel(self, operation_id: str) -> Operation:
        """Cancelled if nothing was sent yet; otherwise the request is recorded and the operation ends as
        what really happened."""
        return self._send(calls.cancel(operation_id))

    def operations(
        self,
        *,
        status: str | None = None,
        action: str | None = None,
        idempotency_key: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page:
        """One page, newest first; pass ``page.next_cursor`` as ``cursor`` for the next."""
        return self._send(
            calls.operations(status=status, action=action, idempotency_key=idempotency_key, limit=limit, cursor=cursor)
        )

    def iter_operations(
        self,
        *,
        page_size: int = 100,
        status: str | None = None,
        action: str | None = None,
        idempotency_key: str | None = None,
    ) -> Iterator[Operation]:
        """Every operation matching the filters, newest first, page by page."""
        cursor: str | None = None
        while True:
            page = self.operations(
                status=status, action=action, idempotency_key=idempotency_key, limit=page_size, cursor=cursor
            )
            yield from page.operations
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def submit_run(
        self,
        run_key: str,
        steps: Sequence[Mapping[str, Any]],
        *,
        budget: Mapping[str, Any] | None = None,
        subject: str | None = None,
        priority: int | None = None,
    ) -> Run:
        """Submit a run (steps in order, each once); ``.new`` False when the same run was there."""
        return self._send(calls.submit_run(run_key, steps, budget=budget, subject=subject, priority=priority))

    def get_run(self, run_id: str) -> Run:
        return self._send(calls.get_run(run_id))

    def cancel_run(self, run_id: str, *, compensate: bool = False) -> Run:
        """Cancel future steps; ``compensate``: also undo completed steps in reverse order."""
        return self._send(calls.cancel_run(run_id, compensate=compensate))

    # -- operators --------------------------------------------------------------------------
    def approvals(self) -> list[PendingApproval]:
        """This tenant's operations awaiting approval, oldest first (scope ``approve``)."""
        return self._send(calls.approvals())

    def approve(self, operation_id: str, *, by: str, note: str | None = None) -> Approval:
        """SeparationOfDuties when this key submitted the intent and the action wants another approver."""
        return self._send(calls.decide(operation_id, approve=True, by=by, note=note))

    def deny(self, operation_id: str, *, by: str, note: str) -> Approval:
        """The operation ends cancelled with the reason; nothing is sent."""
        return self._send(calls.decide(operation_id, approve=False, by=by, note=note))

    def handoffs(self, *, include_resolved: bool = False) -> list[Handoff]:
        """Open handoffs, oldest first (scope ``operate``)."""
        return self._send(calls.handoffs(include_resolved=include_resolved))

    def handoff(self, handoff_id: int) -> Handoff:
        return self._send(calls.handoff(handoff_id))

    def resolve_handoff(
        self, handoff_id: int, *, resolution: str, note: str, by: str, reference: str | None = None
    ) -> Handoff:
        """``resolution``: succeeded (with the provider's ``reference``), not-executed or abandoned."""
        return self._send(
            calls.resolve_handoff(handoff_id, resolution=resolution, note=note, by=by, reference=reference)
        )

    # -- the wire ---------------------------------------------------------------------------
    def _send(self, call: calls.Call[T]) -> T:
        retrying = tenacity.Retrying(**self.retry.tenacity_kwargs(call.replay_safe))
        response: httpx.Response = retrying(self._once, call)
        return call.read(response)

    def _once(self, call: calls.Call[Any]) -> httpx.Response:
        asked = request_of(call, self.base_url, self._headers, self.timeout_s)
        try:
            response = self.http.request(**asked)
        except (httpx.LocalProtocolError, httpx.UnsupportedProtocol):
            raise  # could not be sent as asked (a bad header, a bad URL): sending again changes nothing
        except httpx.TransportError as exc:
            raise unreachable(call.method, asked["url"], exc, call.idempotency_key) from exc
        return answered(response)

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def __enter__(self) -> OutboxClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
