"""Traces from the outbox's own processes (relay, workers, reconciler, beat, API, MCP): OpenTelemetry's
SDK, configured by the standard ``OTEL_*`` variables, off unless asked for.

On when ``OUTBOX_TRACING=otel``, or when ``OTEL_TRACES_EXPORTER`` (other than ``none``) or an OTLP
endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set;
``OUTBOX_TRACING=off`` turns it off whatever else is set. Exporter ``otlp`` (the default: OTLP over
HTTP, ``OTEL_EXPORTER_OTLP_*``) or ``console``; service name ``OTEL_SERVICE_NAME`` (default
``agent-outbox``), sampler ``OTEL_TRACES_SAMPLER``, batching ``OTEL_BSP_*``: the SDK reads them.
Off, the ledger's port stays the no-op (nothing imported, nothing spent on the hot path); an
explicit traceparent (an HTTP header, an MCP request's meta) is still stored with the intent.

Needs the ``otel`` extra; asked for without it, the process stops saying which extra to install.
"""

from __future__ import annotations

import logging
import os

from outbox.errors import MissingDependency
from outbox.ledger import tracing

log = logging.getLogger(__name__)
ENV = "OUTBOX_TRACING"
_configured: bool | None = None


def wanted(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ) if env is None else env
    mode = env.get(ENV, "").strip().lower()
    if mode in ("off", "none", "false", "0"):
        return False
    if mode == "otel":
        return True
    if mode:
        from outbox.errors import ConfigError

        raise ConfigError(f"{ENV}: {mode!r} is not a tracing mode; use otel or off (or leave it unset)")
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure() -> bool:
    """Once per process: the SDK and the ledger's port when tracing is wanted; the no-op otherwise.
    Returns whether this process traces."""
    global _configured
    if _configured is not None:
        return _configured
    if not wanted():
        tracing.install(None)  # even where producer installed the adapter: nothing on the hot path
        _configured = False
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

        from producer.tracing import install
    except ImportError as exc:
        raise MissingDependency(
            f"tracing is on ({ENV} or OTEL_* variables) but OpenTelemetry is not installed: "
            "pip install 'agent-outbox-ledger[otel]'"
        ) from exc
    name = os.environ.get("OTEL_SERVICE_NAME") or "agent-outbox"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    exporter: SpanExporter
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    install()
    log.info("tracing on: OpenTelemetry, service %s", name)
    _configured = True
    return True


def flush() -> None:
    """Export what is batched (a Celery child about to exit)."""
    if _configured:
        from opentelemetry import trace

        provider = trace.get_tracer_provider()
        force = getattr(provider, "force_flush", None)
        if force is not None:
            force(5000)
