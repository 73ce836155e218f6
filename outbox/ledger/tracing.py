"""Tracing, as the ledger sees it: a port, not a library.

The ledger opens spans where its own work happens (an intent's submit, a handoff opened, a person's
resolution) and stores each operation's W3C ``traceparent`` so that every later piece of its work,
in whatever process, continues that trace. It never imports a tracing library: a process that
traces installs an adapter (``producer/tracing.py``, OpenTelemetry) with ``install``; until then
every span is a no-op that passes the parent through, at the cost of a function call.

``traceparent``: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`` (W3C Trace Context),
validated at submit like every other field; it is not part of the intent (not in its digest): the
same key with another trace is the same intent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from outbox.errors import InvalidIntent

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
TRACEPARENT_RULE = "traceparent must be W3C trace context: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"


def validate_traceparent(value: Any, field: str = "traceparent") -> str | None:
    """The traceparent as stored (lower case), None for none; ``InvalidIntent`` naming ``field``."""
    if value is None or value == "":
        return None
    text = value.strip().lower() if isinstance(value, str) else None
    m = TRACEPARENT.match(text) if text else None
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        raise InvalidIntent(field, f"{TRACEPARENT_RULE} (ids not all zero); got {str(value)[:80]!r}")
    return text


class Span(Protocol):
    # The context to store or pass on: this span's own when traced, else the parent given (or the
    # caller's ambient one), else None.
    traceparent: str | None

    def set(self, **attributes: Any) -> None: ...

    def fail(self, description: str) -> None: ...


class Tracer(Protocol):
    @property
    def enabled(self) -> bool: ...

    def current(self) -> str | None: ...

    def span(
        self,
        name: str,
        *,
        parent: str | None,
        links: Sequence[str],
        client: bool,
        attributes: dict[str, Any],
    ) -> AbstractContextManager[Span]: ...


class Passed:
    """No span: the parent (or the caller's context) passed through."""

    def __init__(self, traceparent: str | None) -> None:
        self.traceparent = traceparent

    def set(self, **attributes: Any) -> None:
        pass

    def fail(self, description: str) -> None:
        pass


class NoTracer:
    enabled = False

    def current(self) -> str | None:
        return None

    @contextmanager
    def span(
        self, name: str, *, parent: str | None, links: Sequence[str], client: bool, attributes: dict[str, Any]
    ) -> Iterator[Span]:
        yield Passed(parent)


_tracer: Tracer = NoTracer()


def install(tracer: Tracer | None) -> None:
    """This process's tracer (None: none again)."""
    global _tracer
    _tracer = tracer if tracer is not None else NoTracer()


def enabled() -> bool:
    """Whether spans are recorded: work done only for a trace (reading stored traceparents) asks first."""
    return _tracer.enabled


def current() -> str | None:
    """The traceparent of the span this thread is in (None untraced): what a call out carries."""
    return _tracer.current()


def attributes_of(claim: Any) -> dict[str, Any]:
    """The span attributes of a claim's work (outbox/ledger/claims.py Claim)."""
    return {
        "outbox.operation_id": claim.operation_id,
        "outbox.tenant": claim.tenant,
        "outbox.action": claim.action,
        "outbox.attempt": claim.attempt_number,
        "outbox.attempt.kind": getattr(claim.kind, "value", str(claim.kind)),
        "outbox.fencing_token": claim.fencing_token,
    }


def span(
    name: str,
    *,
    parent: str | None = None,
    links: Sequence[str] = (),
    client: bool = False,
    attributes: dict[str, Any] | None = None,
) -> AbstractContextManager[Span]:
    """A span ``name`` continuing ``parent`` (a stored traceparent; None: the caller's current
    context, if any), linked to ``links``; ``client``: a call out to another service."""
    return _tracer.span(name, parent=parent, links=links, client=client, attributes=attributes or {})
