"""The Celery app, configured against the known Celery/Redis failure modes (FAULTS.md).

The message is a doorbell carrying only an operation id; the ledger decides. So the settings
below aim at "never run a business call twice in parallel and never hide a lost message", not at
delivery guarantees Celery cannot give.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.utils.objects import cached_property

from outbox.errors import ConfigError
from outbox.settings import Settings, load_settings
from workers.engine.queues import DISPATCH_QUEUE, DISPATCH_TASK, RECONCILE_TASK, UNKNOWN_QUEUE, ledger_queue
from workers.ground import event_sender, logs, tracing
from workers.wiring import broker_outage, broker_transport, celery_steps

SWEEP_TASK = "outbox.sweep"
# Beat runs the sweep this often in case no relay is running; the relay itself sweeps every second.
SWEEP_EVERY_S = 15.0
PURGE_TASK = "outbox.purge"
PURGE_EVERY_S = 86400.0  # retention (OUTBOX_ARGS_RETENTION_S): arguments of old terminal operations
REPORT_TASK = "outbox.report"
REPORT_EVERY_S = 3600.0  # the reconciliation report over the last 24 h, kept in the ledger


def fleet_queues(queues: list[str], ledgers: list[str | None]) -> list[str]:
    """What a worker told to consume ``queues`` consumes: each doorbell queue also stands for the
    same queue of every ledger of the fleet (the plain one stays: beat's tasks travel on it)."""
    out = list(queues)
    for kind in (DISPATCH_QUEUE, UNKNOWN_QUEUE):
        if kind in queues:
            out += [ledger_queue(kind, name) for name in ledgers if name is not None]
    return list(dict.fromkeys(out))


# The embedded broker (kombu's SQLAlchemy transport) polls; its interval can only be set on the
# transport class (transport options are passed to create_engine). 50 ms keeps the demo snappy
# while costing one indexed SELECT per idle consumer per tick.
EMBEDDED_POLL_S = 0.05


def check_time_limits(settings: Settings, *, longest_call_s: float = 0.0) -> None:
    """soft limit < hard limit < lease < visibility timeout, and a call fits in the soft limit.

    A task killed by the hard limit must already be dead when its lease expires (else two workers
    could call at once), and Redis must not redeliver a message whose lease still holds.
    """
    chain = [
        ("OUTBOX_SOFT_TIME_LIMIT_S", settings.soft_time_limit_s),
        ("OUTBOX_TIME_LIMIT_S", settings.time_limit_s),
        ("OUTBOX_LEASE_S", settings.lease_s),
        ("OUTBOX_VISIBILITY_TIMEOUT_S", settings.visibility_timeout_s),
    ]
    for (name_a, a), (name_b, b) in zip(chain, chain[1:]):
        if not a < b:
            raise ConfigError(
                f"{name_a}={a:g} must be smaller than {name_b}={b:g} "
                "(required: soft time limit < hard time limit < lease < visibility timeout)"
            )
    if longest_call_s and not longest_call_s < settings.soft_time_limit_s:
        raise ConfigError(
            f"a target's timeout_s + connect_timeout_s ({longest_call_s:g}s) must be smaller than "
            f"OUTBOX_SOFT_TIME_LIMIT_S={settings.soft_time_limit_s:g}"
        )


def celery_config(settings: Settings) -> dict[str, Any]:
    return dict(
        broker_url=settings.resolved_broker_url,
        # JSON only: pickle would let whoever can write to the broker run code in the worker.
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # The ledger is the result; a result backend only adds a way to hang (celery#4857).
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        # Ack after the task ran, and re-queue if the worker process died (celery#3541); the
        # fencing token makes the redelivery harmless.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # One message at a time per process: prefetched doorbells die with the worker (celery#7924).
        worker_prefetch_multiplier=1,
        task_soft_time_limit=settings.soft_time_limit_s,
        task_time_limit=settings.time_limit_s,
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # After a broker connection loss, long tasks are cancelled rather than run twice (PR #6654).
        worker_cancel_long_running_tasks_on_connection_loss=True,
        # The SQLAlchemy transport passes its options to create_engine: only Redis gets these.
        broker_transport_options=({} if settings.embedded_broker else _redis_options(settings)),
        task_default_queue=DISPATCH_QUEUE,
        task_routes={
            DISPATCH_TASK: {"queue": DISPATCH_QUEUE},
            RECONCILE_TASK: {"queue": UNKNOWN_QUEUE},
            SWEEP_TASK: {"queue": DISPATCH_QUEUE},
            PURGE_TASK: {"queue": DISPATCH_QUEUE},
            REPORT_TASK: {"queue": DISPATCH_QUEUE},
        },
        beat_schedule={
            "sweep": {
                "task": SWEEP_TASK,
                "schedule": SWEEP_EVERY_S,
                # A sweep that waited longer than its period is superseded.
                "options": {"expires": SWEEP_EVERY_S},
            },
            "purge": {"task": PURGE_TASK, "schedule": PURGE_EVERY_S, "options": {"expires": PURGE_EVERY_S}},
            "report": {"task": REPORT_TASK, "schedule": REPORT_EVERY_S, "options": {"expires": REPORT_EVERY_S}},
        },
        worker_hijack_root_logger=False,
        # beat's default scheduler, beating at each tick when OUTBOX_HEARTBEAT_FILE is set.
        beat_scheduler="workers.wiring.celery_steps:BeatScheduler",
        # Task events: Flower turns them on when it connects (enable_events), OUTBOX_TASK_EVENTS=true
        # keeps them on from the start; each call and lookup is then a task (call_events.py). No
        # task-sent events: a doorbell is no task of Flower's (it would stay PENDING there forever).
        worker_send_task_events=settings.task_events,
        task_send_sent_event=False,
        enable_utc=True,
    )


def _redis_options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout_s}
    if settings.broker_key_prefix:
        options["global_keyprefix"] = settings.broker_key_prefix
    return options


class OutboxCelery(Celery):  # type: ignore[misc]
    """Celery, whose ``celery worker`` and ``celery beat`` keep OUTBOX_LOG_FORMAT=json whole: their
    banners and console lines as JSON records (celery_console.py, imported only by those programs)."""

    @cached_property
    def Worker(self) -> Any:  # noqa: N802 - Celery's name
        return self.subclass_with_self("workers.wiring.celery_console:Worker")

    @cached_property
    def Beat(self) -> Any:  # noqa: N802 - Celery's name
        return self.subclass_with_self("workers.wiring.celery_console:Beat")


def make_app(settings: Settings | None = None) -> Celery:
    settings = settings or load_settings()
    check_time_limits(settings)
    logs.configure_early()
    tracing.configure()
    # A broker outage is one WARNING per process, not an ERROR per reconnection attempt, and it
    # no longer takes a prefork worker down with it (both modules say why).
    broker_outage.install()
    broker_transport.install()
    if settings.embedded_broker:
        from kombu.transport import sqlalchemy as kombu_sqla

        kombu_sqla.Transport.polling_interval = EMBEDDED_POLL_S
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    app = OutboxCelery("agent_outbox", set_as_current=True)
    app.conf.update(celery_config(settings))
    app.conf.include = ["workers.wiring.tasks"]
    # Liveness: a worker's consumer and beat's ticks touch OUTBOX_HEARTBEAT_FILE (heartbeat.py).
    app.steps["consumer"].add(celery_steps.WorkerHeartbeat)
    # The pool's call threads send task events while the worker does (-E, Flower's enable_events).
    app.steps["consumer"].add(event_sender.TaskEventsSwitch)
    return app
