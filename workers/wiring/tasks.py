"""Celery tasks. Each takes only an operation id (the broker sees nothing else).

None sends task events of its own (``send_events=False``): a doorbell's SUCCESS in milliseconds says
nothing of its calls, and beat's upkeep is no operation. Flower shows the operations instead, each
call and lookup a task of its own (call_events.py), so its succeeded and failed counts are the
ledger's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutdown,
)

from workers.engine.queues import DISPATCH_TASK, RECONCILE_TASK
from workers.ground import event_sender, logs, metrics, tracing
from workers.wiring import soft_limit
from workers.wiring.celery_app import (
    PURGE_TASK,
    REPORT_TASK,
    SWEEP_TASK,
    fleet_queues,
    make_app,
)

if TYPE_CHECKING:  # imported where used: a task module import stays light
    from workers.wiring.runtime import Runtime

log = logging.getLogger(__name__)

app = make_app()


@after_setup_logger.connect
@after_setup_task_logger.connect
def _log_format(logger: logging.Logger, **_: object) -> None:
    # Celery's worker and beat set up their own handlers (and the task logger's): OUTBOX_LOG_FORMAT
    # applies to them as to every other process (make_app validated it).
    logs.use_format(logger)


@worker_process_init.connect
def _fresh_runtime(**_: object) -> None:
    # A forked child must not reuse its parent's database or HTTP connections.
    from workers.wiring.runtime import reset_runtime

    reset_runtime()


@celeryd_after_setup.connect
def _ledger_queues(instance: object, **_: object) -> None:
    # A fleet draining several ledgers (OUTBOX_DATABASE_URLS): -Q dispatch (or no -Q) consumes every
    # ledger's dispatch queue too, so `celery -A workers worker -Q dispatch` needs no list of names.
    from outbox.settings import load_settings

    ledgers = list(load_settings().ledger_urls)
    if None in ledgers:
        return
    queues = instance.app.amqp.queues  # type: ignore[attr-defined]
    selected = list(queues.consume_from or queues)
    for name in fleet_queues(selected, ledgers):
        if name not in selected:
            queues.select_add(name)


# Main process, before the pool forks: empty the multiprocess metrics dir, serve it if asked.
worker_init.connect(metrics.on_worker_init)

# Main process, before the pool forks: the switch its pool reads to send each call's task events.
worker_init.connect(event_sender.on_worker_init)

# A pool process: a soft limit's signal acts only on the task it was armed for (soft_limit.py).
task_prerun.connect(soft_limit.on_task_prerun)
task_postrun.connect(soft_limit.on_task_postrun)


@worker_init.connect
def _preload(**_: object) -> None:
    # The main process imports what every task process needs (the ledger, SQLAlchemy, psycopg,
    # httpx, the breakers) before the pool forks: the children share those pages instead of each
    # importing its own copy after the fork (memory and start-up CPU per child).
    # Modules only: no connection is opened here, so a child has nothing of its parent's to reuse.
    import contextlib
    import gc

    import workers.dispatch.batch  # noqa: F401
    import workers.reconcile.batch  # noqa: F401
    import workers.wiring.runtime  # noqa: F401

    # The ledger imports its PostgreSQL driver (and psycopg) on first use; a SQLite-only install may
    # have no psycopg implementation, and then there is nothing to share.
    with contextlib.suppress(ImportError):
        import outbox.ledger.drivers.postgres  # noqa: F401

    # The collector writes to every object it scans: frozen, the imported objects stay out of its
    # scans, so their pages stay shared after the fork (copy-on-write) instead of being copied.
    gc.freeze()


@worker_shutdown.connect
def _close_solo_runtime(**_: object) -> None:
    # A solo (or threads) pool runs tasks in the main process: let its calls out be finalized.
    from workers.wiring.runtime import reset_runtime

    reset_runtime()
    event_sender.flush()  # the finalized calls' task events, before the process ends


@worker_process_shutdown.connect
def _close_runtime(**kw: object) -> None:
    from workers.wiring.runtime import reset_runtime

    try:
        reset_runtime()
    finally:
        soft_limit.on_process_shutdown()  # a stale soft limit met while draining is said here
    tracing.flush()
    event_sender.flush()
    pid = kw.get("pid")
    metrics.on_worker_process_shutdown(pid=pid if isinstance(pid, int) else None)


@app.task(name=DISPATCH_TASK, ignore_result=True, send_events=False)
def dispatch(operation_ids: str | list[str], ledger: str | None = None) -> None:
    """One doorbell: an operation id, or a batch of them (OUTBOX_DOORBELL_BATCH), of ``ledger`` (a
    fleet's: OUTBOX_DATABASE_URLS; None: the one ledger)."""
    from workers.ground.outage import riding_out_outages

    ids = _ids(operation_ids)
    rt = _runtime_of(ledger, ids)
    if rt is None:
        return
    with riding_out_outages(_task_name("dispatch", ledger), ids):
        # Returns once its calls are out: the process takes the next doorbell while they run.
        rt.dispatcher.dispatch(ids, wait=False)


@app.task(name=RECONCILE_TASK, ignore_result=True, send_events=False)
def reconcile(operation_ids: str | list[str], ledger: str | None = None) -> None:
    """One reconcile doorbell: an operation id, or a batch of them, topped up with whatever else is
    due; the lookups run on the process's lookup threads and the task returns at once."""
    from workers.ground.outage import riding_out_outages

    ids = _ids(operation_ids)
    rt = _runtime_of(ledger, ids)
    if rt is None:
        return
    with riding_out_outages(_task_name("reconcile", ledger), ids):
        # Returns once its lookups are out: the process takes the next doorbell while they run.
        rt.reconciler.reconcile(ids, fill_to=rt.settings.doorbell_batch, wait=False)


def _runtime_of(ledger: str | None, ids: list[str]) -> Runtime | None:
    """The runtime of the doorbell's ledger; None (and an ERROR: nothing this worker does will
    serve them) when this worker does not drain it. The operations wait in their ledger, unharmed,
    for a worker that does; the relay rings again."""
    from workers.wiring.runtime import UnknownLedger, get_runtime

    try:
        return get_runtime(app, ledger)
    except UnknownLedger as exc:
        log.error("doorbell dropped: %s", exc, extra={"operation_ids": ids})
        return None


def _task_name(task: str, ledger: str | None) -> str:
    return task if ledger is None else f"{task} (ledger {ledger})"


def _ids(operation_ids: str | list[str]) -> list[str]:
    # A doorbell carries one id (older messages, and batches of one) or a list.
    return [operation_ids] if isinstance(operation_ids, str) else operation_ids


@app.task(name=SWEEP_TASK, ignore_result=True, send_events=False)
def sweep() -> None:
    """Beat's backstop for the relay: expired leases -> outcome_unknown, lost doorbells re-published
    (in every ledger the fleet drains; one that is down is skipped with a WARNING)."""
    _every_ledger("sweep", _sweep_once)


@app.task(name=PURGE_TASK, ignore_result=True, send_events=False)
def purge() -> None:
    """Beat, daily: arguments and provider responses of terminal operations older than
    OUTBOX_ARGS_RETENTION_S (outbox/privacy/retention.py; the worker checked the retention at start-up)."""
    from outbox.privacy.retention import purge as purge_old

    def purge_one(rt: Runtime) -> None:
        done = purge_old(rt.sessions, older_than_s=rt.settings.args_retention_s)
        if done.operations:
            log.info("purge: arguments and responses of %d terminal operation(s) removed", done.operations)

    _every_ledger("purge", purge_one)


@app.task(name=REPORT_TASK, ignore_result=True, send_events=False)
def report() -> None:
    """Beat, hourly: the reconciliation report over the last 24 h (workers/provider/listing_report.py), kept in
    the ledger for the exporter, the API and the console (outbox/reads/report_summary.py)."""
    import datetime as dt

    from outbox.reads.report_summary import record_report
    from workers.provider.listing_report import build_report

    def report_one(rt: Runtime) -> None:
        now = dt.datetime.now(dt.UTC)
        with rt.sessions() as session:
            found = build_report(
                session,
                rt.actions,
                since=now - dt.timedelta(hours=24),
                now=now,
                same_object_window_s=rt.settings.report_same_object_window_s,
            )
        with rt.sessions.begin() as session:
            record_report(session, found, started_at=now, finished_at=dt.datetime.now(dt.UTC), ran_by="beat")
        if found["discrepancy_count"]:
            log.warning("report: %d discrepancies (agent-outbox report shows them)", found["discrepancy_count"])

    _every_ledger("report", report_one)


def _every_ledger(task: str, body: Callable[[Runtime], None]) -> None:
    """``body`` on each ledger's runtime in turn, inside riding_out_outages: an outage of one ledger
    is its WARNING and the next ledger's turn; any other error of one ledger its ERROR, and the next
    ledger's turn too."""
    from workers.ground.outage import riding_out_outages
    from workers.wiring.runtime import get_fleet

    fleet = get_fleet(app)
    for name in fleet.names:
        try:
            with riding_out_outages(_task_name(task, name), []):
                body(fleet.runtime(name))
        except SoftTimeLimitExceeded:
            raise  # the task's time is up: it ends here, not in the next ledger under the hard limit
        except Exception:
            if len(fleet.names) == 1:
                raise  # the one ledger: Celery reports it, as it always did
            # Not an outage (a ledger not migrated yet, a bug): said, and the next ledger's turn.
            log.exception("%s failed; the other ledgers' turns go on", _task_name(task, name))


def _sweep_once(rt: Runtime) -> None:
    from workers.relay.loop import Relay

    relay = Relay(
        rt.engine,
        rt.doorbell,
        republish_after_s=rt.settings.republish_after_s,
        evidence_sink=rt.evidence,
        actions=rt.actions,
        max_queued=rt.settings.relay_max_queued,
    )
    tick = relay.run_once()
    if tick.busy:
        log.info(
            "sweep: %d lease(s) expired, %d dispatch and %d reconcile doorbell(s) re-published",
            tick.expired,
            tick.dispatch,
            tick.reconcile,
        )
