"""Celery's own console lines under OUTBOX_LOG_FORMAT=json: its worker's and beat's banners and the
worker's shutdown lines, as JSON records.

Celery prints its banners (about 20 lines of ASCII art and facts per start) and a few lines of its
signal handlers ("worker: Warm shutdown (MainProcess)") straight to the terminal, past logging. In
json every line a process writes is one JSON object (a log shipper that parses JSON drops or mangles
anything else), so here:

- the worker's banner is one record, ``celery worker starting``, its facts as fields (node name,
  transport with the password masked, pool, concurrency, task events, queues, versions);
- beat's is one record, ``celery beat starting`` (transport, scheduler, schedule file, max interval);
- a line Celery's signal handlers say (``safe_say``) is one record of logger ``celery.apps.worker``,
  written as Celery writes it (one ``os.write``, safe inside a signal handler).

Text: Celery's output as ever. The app (celery_app.py) makes ``celery worker`` and ``celery beat``
use these programs, so they hold however the process is started (compose, ``agent-outbox run``).
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from typing import Any

import celery
from celery.apps.beat import Beat as CeleryBeat
from celery.apps.worker import Worker as CeleryWorker
from celery.signals import beat_init

from outbox.errors import ConfigError
from outbox.settings import LogFormat
from workers.ground import logs

log = logging.getLogger("celery.apps.worker")
beat_log = logging.getLogger("celery.beat")


def json_mode() -> bool:
    try:
        return logs.log_format() is LogFormat.JSON
    except ConfigError:
        return False  # make_app refused it already; nothing to say here


class Worker(CeleryWorker):  # type: ignore[misc]
    """``celery worker``: in json, its banner one record and its signal handlers' lines records."""

    def on_before_init(self, quiet: bool = False, **kwargs: Any) -> None:
        if json_mode():
            import celery.apps.worker as program

            program.safe_say = say  # looked up at each call: the shutdown handlers' lines
        super().on_before_init(quiet=quiet, **kwargs)

    def emit_banner(self) -> None:
        if not json_mode():
            super().emit_banner()
            return
        pool = self.pool_cls if isinstance(self.pool_cls, str) else self.pool_cls.__module__
        queues = self.app.amqp.queues.consume_from or self.app.amqp.queues
        log.info(
            "celery worker starting",
            extra={
                "hostname": self.hostname,
                "celery_version": celery.__version__,
                "transport": self.app.connection().as_uri(),  # the password masked
                "pool": pool.split(".")[-1],
                "concurrency": self.concurrency,
                "task_events": bool(self.task_events),
                "queues": sorted(queues),
                "tasks": sorted(name for name in self.app.tasks if not name.startswith("celery.")),
                "platform": platform.platform(),
            },
        )


class Beat(CeleryBeat):  # type: ignore[misc]
    """``celery beat``: in json, no banner printed; its facts one record once logging is set up."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        json = json_mode()
        super().__init__(*args, quiet=quiet or json, **kwargs)
        if json:
            beat_init.connect(_beat_facts, weak=False)


def _beat_facts(sender: Any = None, **_: Any) -> None:
    scheduler = sender.get_scheduler(lazy=True) if sender is not None else None
    beat_log.info(
        "celery beat starting",
        extra={
            "celery_version": celery.__version__,
            "transport": sender.app.connection().as_uri() if sender is not None else None,
            "scheduler": type(scheduler).__name__ if scheduler is not None else None,
            "schedule_file": getattr(sender, "schedule_filename", None),
            "max_interval_s": getattr(scheduler, "max_interval", None),
        },
    )


def say(msg: str, f: Any = sys.__stderr__) -> None:
    """celery.apps.worker.safe_say's stand-in in json: the same line, as one JSON record, written
    the same way (one os.write: it runs inside signal handlers)."""
    record = logging.LogRecord("celery.apps.worker", logging.INFO, __file__, 0, msg, None, None)
    line = logs.JsonFormatter().format(record) + "\n"
    try:
        os.write(f.fileno(), line.encode())
    except (OSError, AttributeError, ValueError):
        pass  # as Celery's: losing the line must never stop a shutdown
