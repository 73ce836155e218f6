"""OpenTelemetry for the ledger's tracing port (outbox/ledger/tracing.py): the adapter.

Installed where OpenTelemetry is importable (the ``otel`` extra): by ``producer`` on import, so an
agent's own submit continues the agent's current trace, and by the workers' processes when tracing
is on (workers/ground/tracing.py configures the SDK from the standard ``OTEL_*`` variables). With
no SDK configured the API's no-op tracer hands the caller's context through: the stored
traceparent is the agent's current span, and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox.ledger import tracing

_PROPAGATOR = TraceContextTextMapPropagator()
INSTRUMENTATION = "agent-outbox"


def context_of(traceparent: str | None) -> Any:
    """The OpenTelemetry context a stored traceparent names (None: the current one)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None


def traceparent_of(context: Any = None) -> str | None:
    """The W3C traceparent of ``context`` (None: the current one), None without a valid span."""
    ctx = trace.get_current_span(context).get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class _Span:
    def __init__(self, span: trace.Span, parent: str | None) -> None:
        self._span = span
        own = span.get_span_context()
        self.traceparent = traceparent_of(trace.set_span_in_context(span)) if own.is_valid else parent

    def set(self, **attributes: Any) -> None:
        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def fail(self, description: str) -> None:
        self._span.set_status(Status(StatusCode.ERROR, description))


class OpenTelemetryTracer:
    """The port on OpenTelemetry's API: the process's provider, or ``provider`` (a test's own)."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        self._provider = provider

    @property
    def enabled(self) -> bool:
        provider = self._provider or trace.get_tracer_provider()
        return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))

    def current(self) -> str | None:
        return traceparent_of()

    @contextmanager
    def span(
        self, name: str, *, parent: str | None, links: Sequence[str], client: bool, attributes: dict[str, Any]
    ) -> Iterator[tracing.Span]:
        if not self.enabled:  # no SDK configured: nothing is recorded, the context passes through
            yield tracing.Passed(parent if parent else traceparent_of())
            return
        linked = [Link(ctx) for ctx in (_span_context(t) for t in links if t and t != parent) if ctx is not None]
        tracer = trace.get_tracer(INSTRUMENTATION, tracer_provider=self._provider)
        with tracer.start_as_current_span(
            name,
            context=context_of(parent),
            kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
            links=linked,
            attributes={k: v for k, v in attributes.items() if v is not None},
        ) as span:
            yield _Span(span, parent if parent else traceparent_of())


def _span_context(traceparent: str) -> trace.SpanContext | None:
    ctx = trace.get_current_span(context_of(traceparent)).get_span_context()
    return ctx if ctx.is_valid else None


def install() -> None:
    tracing.install(OpenTelemetryTracer())
