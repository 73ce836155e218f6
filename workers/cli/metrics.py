"""``agent-outbox metrics``: serve ``/metrics`` for Prometheus.

One registry combines:
- the ledger, read at scrape time (``outbox.reads.metrics.LedgerCollector``): operations by
  status, the outcome_unknown backlog and its age, open handoffs and their age, the last report;
- breaker state per target from Redis (``breaker.metrics.BreakerCollector``), when
  OUTBOX_REDIS_URL and OUTBOX_ACTIONS_FILE are set;
- the process metrics of workers and relay (``workers.ground.metrics``) summed over
  ``PROMETHEUS_MULTIPROC_DIR``, when this exporter runs on the same host as them and shares the
  directory. Workers in other containers serve their own (OUTBOX_METRICS_PORT; docs/reference/metrics.md).

It never records anything itself, so it never writes into the shared directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess

from outbox.reads.metrics import LedgerCollector
from outbox.settings import Settings, load_settings
from workers.cli.ledger import LedgerUnavailable, open_engine

log = logging.getLogger(__name__)

DEFAULT_PORT = 9808


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("metrics", help="serve /metrics for Prometheus (ledger, breakers, worker processes)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.set_defaults(func=cmd_metrics)


def build_registry(settings: Settings) -> CollectorRegistry:
    registry = CollectorRegistry()
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    try:
        engine = open_engine(settings)
    except LedgerUnavailable as exc:
        # Start anyway: the scrape says outbox_ledger_up 0 until the ledger answers.
        log.warning("metrics: %s", exc)
        engine = open_engine(settings, ensure_schema=False)
    registry.register(
        LedgerCollector(
            engine,
            terminal_window_s=settings.metrics_terminal_window_s,
            tenants=settings.metrics_tenants,
            unowned_after_s=settings.handoff_unowned_alert_s,
            targets=_targets(settings),
        )
    )
    if settings.redis_url and settings.actions_file is not None:
        from breaker.metrics import BreakerCollector
        from workers.wiring.builders import breaker_registry, load_actions_for

        breakers = breaker_registry(settings, load_actions_for(settings))
        breakers.close()  # only its configuration is needed: the collector reads Redis itself
        registry.register(BreakerCollector(settings.redis_url, list(breakers.configs), breakers.namespace))
    else:
        log.info("metrics: no breaker states (they need OUTBOX_REDIS_URL and OUTBOX_ACTIONS_FILE)")
    return registry


def _targets(settings: Settings) -> dict[str, str]:
    """Each action's target (the unowned handoffs' label); none without a readable actions file."""
    if settings.actions_file is None:
        return {}
    from workers.wiring.builders import load_actions_for

    try:
        return {name: action.target for name, action in load_actions_for(settings).actions.items()}
    except Exception as exc:  # noqa: BLE001 - the exporter serves the rest; the label says "unknown"
        log.warning("metrics: actions file not read (%s): unowned handoffs are labelled target=unknown", exc)
        return {}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        return  # one line per scrape is noise


def cmd_metrics(args: argparse.Namespace) -> int:
    settings = load_settings()
    registry = build_registry(settings)
    server = make_server(args.host, args.port, make_wsgi_app(registry), handler_class=_QuietHandler)
    stop = threading.Event()

    def _stop(*_: object) -> None:
        if not stop.is_set():
            stop.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    host, port = args.host, server.server_port
    print(f"agent-outbox metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
