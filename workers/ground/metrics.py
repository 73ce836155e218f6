"""Process-side metrics: what dispatch, the reconciler and the relay observe, per process.

Multiprocess-safe for Celery's prefork pool through prometheus_client's multiprocess mode:

- ``PROMETHEUS_MULTIPROC_DIR`` must be in the environment BEFORE the worker (or relay) starts:
  prometheus_client picks its value store when it is first imported, and prefork children inherit
  the parent's environment. Each process then writes its samples to ``<dir>/<type>_<pid>.db``
  and an exporter sums the files (``multiprocess_registry``).
- The directory must be empty when the process group starts (files of an earlier run would be
  summed in, and a reused pid would continue an old file). ``wipe_multiproc_dir`` does it; the
  Celery hook ``on_worker_init`` calls it when this worker serves its own metrics
  (``OUTBOX_METRICS_PORT``), otherwise the start script does (``rm -f $PROMETHEUS_MULTIPROC_DIR/*.db``).
- Counters and histograms are summed across processes and a dead child's counts stay in the
  sums, as they should; gauges are live (livesum, livemax), and ``mark_process_dead`` (for
  Celery's ``worker_process_shutdown``) drops a dead child's.

Without ``PROMETHEUS_MULTIPROC_DIR`` the values live in this process's memory (``PROCESS_REGISTRY``):
right for a single-process relay that serves its own port.

Labels are ``target`` (from the actions file), ``class`` (``AttemptClass``), ``status``
(``Status``), ``limit`` (rate, concurrency), and on the HTTP API's series ``method``, ``route`` (the
route's template) and ``status`` (the HTTP code) only: never keys, tenants, ids or arguments. A
recording function never raises: a metrics failure (disk full under the multiprocess dir) must not
fail a dispatch.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

from outbox.ledger.states import AttemptClass, Status

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
KNOWN_CLASSES = frozenset(c.value for c in AttemptClass)
KNOWN_STATUSES = frozenset(s.value for s in Status)

PROCESS_REGISTRY = CollectorRegistry()

# Buckets: HTTP attempts are bounded by a target's timeout_s (seconds); retry delays by the
# budget's max_delay_s (minutes) and Retry-After (up to an hour in practice); the relay's lag
# is milliseconds when NOTIFY works and the poll interval (0.5 s) or republish_after_s (30 s)
# when it does not.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DELAY_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 30.0, 60.0, 300.0)

ATTEMPTS = Counter(
    "outbox_attempts", "Dispatch attempts by target and class", ["target", "class"], registry=PROCESS_REGISTRY
)
ATTEMPT_LATENCY = Histogram(
    "outbox_attempt_latency_seconds",
    "Duration of one dispatch attempt (HTTP call), by target and class",
    ["target", "class"],
    buckets=LATENCY_BUCKETS,
    registry=PROCESS_REGISTRY,
)
RETRY_DELAY = Histogram(
    "outbox_retry_delay_seconds",
    "Delay of each scheduled retry, by target",
    ["target"],
    buckets=DELAY_BUCKETS,
    registry=PROCESS_REGISTRY,
)
RETRY_AFTER = Histogram(
    "outbox_retry_after_seconds",
    "Retry-After asked by the provider on a retried attempt (count = waits honoured)",
    ["target"],
    buckets=DELAY_BUCKETS,
    registry=PROCESS_REGISTRY,
)
OUTCOMES = Counter(
    "outbox_outcomes",
    "Outcomes applied by workers, by the status the operation moved to",
    ["status"],
    registry=PROCESS_REGISTRY,
)
RELAY_LAG = Histogram(
    "outbox_relay_lag_seconds",
    "From an operation being due (commit, or its retry time) to the relay publishing its doorbell",
    buckets=LAG_BUCKETS,
    registry=PROCESS_REGISTRY,
)
DISPATCH_QUEUE_DEPTH = Gauge(
    "outbox_dispatch_queue_depth",
    "Dispatch doorbells waiting in the broker, as the relay last read it (bounded by OUTBOX_RELAY_MAX_QUEUED)",
    multiprocess_mode="livemax",
    labelnames=("ledger",),  # a fleet's ledger (OUTBOX_DATABASE_URLS); "" for the one ledger
    registry=PROCESS_REGISTRY,
)
IN_FLIGHT = Gauge(
    "outbox_in_flight_operations",
    "Operations claimed and not yet finalized, summed over worker processes (each <= OUTBOX_MAX_IN_FLIGHT)",
    multiprocess_mode="livesum",
    labelnames=("ledger",),  # a fleet's ledger (OUTBOX_DATABASE_URLS); "" for the one ledger
    registry=PROCESS_REGISTRY,
)
LOOKUPS_IN_FLIGHT = Gauge(
    "outbox_lookups_in_flight",
    "Reconciler lookups claimed and not yet settled, summed over processes (each <= OUTBOX_MAX_IN_FLIGHT)",
    multiprocess_mode="livesum",
    labelnames=("ledger",),  # a fleet's ledger (OUTBOX_DATABASE_URLS); "" for the one ledger
    registry=PROCESS_REGISTRY,
)
RECONCILE_QUEUE_DEPTH = Gauge(
    "outbox_reconcile_queue_depth",
    "Reconcile doorbells waiting in the broker, as the relay last read it (bounded by OUTBOX_RELAY_MAX_QUEUED)",
    multiprocess_mode="livemax",
    labelnames=("ledger",),  # a fleet's ledger (OUTBOX_DATABASE_URLS); "" for the one ledger
    registry=PROCESS_REGISTRY,
)

# Limits (workers/pacing/): waits in a call's thread, calls sent back to the ledger, and whether this
# process counts its limits alone because Redis is away. ``limit`` is rate or concurrency.
LIMIT_WAITS = Counter(
    "outbox_limit_waits",
    "Calls that waited in their thread for a declared limit before they were sent, by target and limit",
    ["target", "limit"],
    registry=PROCESS_REGISTRY,
)
LIMIT_WAIT = Histogram(
    "outbox_limit_wait_seconds",
    "How long a call waited in its thread for a declared limit (at most 1 s: longer waits go back to the ledger)",
    ["target"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=PROCESS_REGISTRY,
)
LIMIT_RELEASED = Counter(
    "outbox_limit_released",
    "Calls sent back to the ledger unsent (not_dispatched, waiting_for rate_limit) by a declared limit",
    ["target", "limit"],
    registry=PROCESS_REGISTRY,
)
PACING_FALLBACK = Gauge(
    "outbox_pacing_fallback",
    "1 while a process keeps to its own share of the declared limits (Redis unreachable); max over processes",
    multiprocess_mode="livemax",
    registry=PROCESS_REGISTRY,
)
EVIDENCE_STORE_DOWN = Gauge(
    "outbox_evidence_store_down",
    "1 while a process sees the separate evidence store (OUTBOX_EVIDENCE_URL) down: actions that require "
    "evidence wait, unsent; max over processes",
    multiprocess_mode="livemax",
    registry=PROCESS_REGISTRY,
)
KNOWN_LIMITS = frozenset({"rate", "concurrency"})
# Calls that reached (or may have reached) the provider again for the same operation: what retries
# cost at a provider that bills per call. The report's definition (outbox/reads/report.py
# retries_by_action, "billable"): a dispatch attempt numbered 2 or more that left this machine.
RETRY_BILLED = Counter(
    "outbox_retry_billed_calls",
    "Dispatch calls numbered 2 and up that left this machine (not not_sent), by target: retries a provider bills",
    ["target"],
    registry=PROCESS_REGISTRY,
)
# The HTTP API's own requests. ``route``: the route's template (/v1/operations/{operation_id}),
# never the raw path, so ids never become label values; "unmatched" for a path no route has.
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
HTTP_REQUESTS = Counter(
    "outbox_http_requests",
    "HTTP API requests by method, route template and status code",
    ["method", "route", "status"],
    registry=PROCESS_REGISTRY,
)
HTTP_DURATION = Histogram(
    "outbox_http_request_duration_seconds",
    "HTTP API request duration (to the last byte of the response) by method and route template",
    ["method", "route"],
    buckets=HTTP_BUCKETS,
    registry=PROCESS_REGISTRY,
)

F = TypeVar("F", bound=Callable[..., None])
_failed_once = False


def _never_raises(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        global _failed_once
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - metrics must never fail a dispatch
            if not _failed_once:
                log.warning("metrics: recording failed (further failures are not logged)", exc_info=True)
            _failed_once = True

    return wrapper  # type: ignore[return-value]


def _target(target: str | None) -> str:
    return target or "unknown"


def _klass(klass: Any) -> str:
    value = getattr(klass, "value", klass)
    return value if value in KNOWN_CLASSES else "invalid"


# -- recording ------------------------------------------------------------------------------
@_never_raises
def record_attempt(target: str | None, klass: AttemptClass | str, latency_s: float | None) -> None:
    """One dispatch attempt that was classified (sent or not). latency_s None: nothing was timed."""
    k = _klass(klass)
    ATTEMPTS.labels(_target(target), k).inc()
    if latency_s is not None:
        ATTEMPT_LATENCY.labels(_target(target), k).observe(max(latency_s, 0.0))


@_never_raises
def record_retry_billed(target: str | None, attempt_number: int, klass: AttemptClass | str) -> None:
    """A dispatch call that left this machine: counted when it is attempt 2 or later."""
    if attempt_number > 1 and _klass(klass) != AttemptClass.NOT_SENT.value:
        RETRY_BILLED.labels(_target(target)).inc()


@_never_raises
def record_http_request(method: str, route: str, status: int, duration_s: float) -> None:
    m = method if method in KNOWN_METHODS else "other"
    HTTP_REQUESTS.labels(m, route, str(status)).inc()
    HTTP_DURATION.labels(m, route).observe(max(duration_s, 0.0))


@_never_raises
def record_retry(target: str | None, delay_s: float, retry_after_s: float | None) -> None:
    """A retry was scheduled delay_s from now; retry_after_s: what the provider asked, if it did."""
    RETRY_DELAY.labels(_target(target)).observe(max(delay_s, 0.0))
    if retry_after_s is not None:
        RETRY_AFTER.labels(_target(target)).observe(max(retry_after_s, 0.0))


@_never_raises
def record_limit_wait(target: str, limit: str, waited_s: float) -> None:
    """A call waited ``waited_s`` in its thread for ``limit`` (rate or concurrency), then went."""
    LIMIT_WAITS.labels(_target(target), limit if limit in KNOWN_LIMITS else "invalid").inc()
    LIMIT_WAIT.labels(_target(target)).observe(max(waited_s, 0.0))


@_never_raises
def record_limit_released(target: str, limit: str) -> None:
    """A call over ``limit`` went back to the ledger unsent, to wait there."""
    LIMIT_RELEASED.labels(_target(target), limit if limit in KNOWN_LIMITS else "invalid").inc()


@_never_raises
def record_pacing_fallback(on: bool) -> None:
    PACING_FALLBACK.set(1 if on else 0)


@_never_raises
def record_evidence_store_down(down: bool) -> None:
    EVIDENCE_STORE_DOWN.set(1 if down else 0)


def watch_evidence_sink(sink: Any) -> None:
    """Keep ``outbox_evidence_store_down`` to what this process sees of a separate evidence store
    (an outbox.evidence.sinks.EvidenceSink): set now, then at each change its health sees."""
    if not getattr(sink, "separate", False):
        return
    sink.health.on_change = lambda up: record_evidence_store_down(not up)
    record_evidence_store_down(sink.health.up is False)


@_never_raises
def record_outcome(status: Status | str) -> None:
    """The status an operation moved to after a worker's guarded transition committed."""
    value = getattr(status, "value", status)
    OUTCOMES.labels(value if value in KNOWN_STATUSES else "invalid").inc()


@_never_raises
def record_dispatch_queue(depth: int, ledger: str | None = None) -> None:
    DISPATCH_QUEUE_DEPTH.labels(ledger=ledger or "").set(depth)


@_never_raises
def record_in_flight(held: int, ledger: str | None = None) -> None:
    IN_FLIGHT.labels(ledger=ledger or "").set(held)


@_never_raises
def record_lookups_in_flight(held: int, ledger: str | None = None) -> None:
    LOOKUPS_IN_FLIGHT.labels(ledger=ledger or "").set(held)


@_never_raises
def record_reconcile_queue(depth: int, ledger: str | None = None) -> None:
    RECONCILE_QUEUE_DEPTH.labels(ledger=ledger or "").set(depth)


@_never_raises
def record_relay_lag(lag_s: float) -> None:
    RELAY_LAG.observe(max(lag_s, 0.0))


@_never_raises
def record_relay_lags(lags_s: Iterable[float | None]) -> None:
    """Every doorbell of one relay tick (lag computed by the database: ``db_age_s(next_attempt_at)``)."""
    for lag in lags_s:
        if lag is not None:
            RELAY_LAG.observe(max(float(lag), 0.0))


# -- exporting ------------------------------------------------------------------------------
def multiproc_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that sums every process's files under ``path`` (default: the env variable)."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path or multiproc_dir())  # type: ignore[no-untyped-call]
    return registry


def process_registry() -> CollectorRegistry:
    """What this process group has recorded: the multiprocess sums, or this process's memory."""
    return multiprocess_registry() if multiproc_dir() else PROCESS_REGISTRY


def wipe_multiproc_dir(path: str | None = None) -> int:
    """Remove the sample files of an earlier run; call before any process of the group records."""
    path = path or multiproc_dir()
    if not path:
        return 0
    os.makedirs(path, exist_ok=True)
    removed = 0
    for f in glob.glob(os.path.join(path, "*.db")):
        os.remove(f)
        removed += 1
    return removed


def mark_process_dead(pid: int) -> None:
    """Celery ``worker_process_shutdown``: drop a dead child's live-gauge files (counters stay)."""
    if multiproc_dir():
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Serve this process group's metrics on ``host:port`` (a daemon thread)."""
    start_http_server(port, addr=host, registry=process_registry())
    log.info("metrics served on %s:%d", host, port, extra={"multiproc_dir": multiproc_dir()})


# -- Celery hooks (connected in workers/wiring/tasks.py) ------------------------------------------
def on_worker_init(**_: object) -> None:
    """``worker_init`` (the main process, before the pool forks): own and serve the directory."""
    from outbox.settings import load_settings

    port = load_settings().metrics_port
    if not port:
        return
    if multiproc_dir():
        wipe_multiproc_dir()
    else:
        log.warning(
            "metrics: OUTBOX_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not: "
            "prefork children's samples cannot be seen by the main process"
        )
    serve(port)


def on_worker_process_shutdown(pid: int | None = None, **_: object) -> None:
    mark_process_dead(pid if pid is not None else os.getpid())
