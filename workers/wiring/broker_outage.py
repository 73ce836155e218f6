"""A broker outage, as Celery and kombu log it, at the house's levels: one WARNING, then INFO.

ERROR is for final failures (DESIGN.md): an operation failed before commit after its retries, or
went to a person. A broker outage is neither. The ledger keeps the work, the relay rings again
whatever the broker lost, and the worker reconnects on its own (``broker_connection_retry*``,
no retry limit). Celery logs it as if it were final:

- ``consumer: Cannot connect to redis://...: Error 111 ... Trying again in 2.00 seconds...`` at
  ERROR, once per reconnection attempt (celery/worker/consumer/consumer.py, CONNECTION_ERROR),
  while the first sign, ``consumer: Connection to broker lost``, is a WARNING;
- ``Couldn't ack 12, reason: ConnectionError(...)`` at CRITICAL with a traceback, for a task that
  finished while the connection was down (kombu's Message.ack_log_error): Redis redelivers the
  doorbell after the visibility timeout, or lost it with a restart and the relay rings again; a
  duplicate doorbell finds nothing to claim;
- on a connection loss Celery cancels the tasks it can no longer acknowledge
  (``worker_cancel_long_running_tasks_on_connection_loss``, celery_app.py): a WARNING per task
  ("Task ... cannot be acknowledged after a connection loss ... Terminating it instead"), then,
  as it leaves their soft time limits armed, "Soft time limit (2.0s) exceeded for ..." at WARNING
  for a task that has ended, and ``Pool process <...Worker...> error: SoftTimeLimitExceeded()`` at
  ERROR when the limit's signal reaches the process while it leaves; and when the leaving process
  is still draining its calls out at the hard limit (a reconcile task's lookups on a loaded
  machine), ``Hard time limit (2.5s) exceeded for ...`` at ERROR, and billiard kills it. The
  operations come back through their leases. Such stale signals no longer raise in a pool process
  (workers/wiring/soft_limit.py); the SIGTERM itself, when it lands while a connection goes back to
  its pool, or inside a statement whose connection then fails its reset, makes SQLAlchemy's
  ``Exception during reset or similar`` at ERROR (the SystemExit, or the reset's own error raised
  while it propagated): the process is leaving and the connection with it. At INFO it is dropped
  unless SQLAlchemy's pool logger is set to INFO (SQLAlchemy sets its loggers to WARNING);
- beat's ``beat: Connection error: ... Trying again in N seconds...`` at ERROR, per attempt.

Celery says every hard time limit twice at ERROR: ``Task handler raised error: TimeLimitExceeded(...)``
(no task named; billiard's traceback of its own timer) and, at once after it, ``Hard time limit
(...) exceeded for <task>[<id>]``. The first is said at INFO: the second is the event's one record,
at ERROR for a task at work and at INFO for one cancelled on the loss, as above.

``BrokerOutageLog`` keeps those records and sets their level: the first record of an outage is its
one WARNING, the rest INFO without traceback (retried, intermediate failures are INFO, STYLE.md),
and "Connected to ..." after an outage says how long it lasted. A worker at ``--loglevel INFO``
still shows every attempt; the pool processes' line then goes where Celery sends billiard's INFO
(nowhere, unless MP_LOG is set). The filter sits on the loggers of exactly those records and
matches them by their message templates and reasons, so every other record, a final failure
included, passes unchanged. The worker crash kombu used to add to an outage is fixed in
workers/wiring/broker_transport.py, not filtered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kombu.exceptions
import redis.exceptions
from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from workers.wiring import soft_limit

# Errors meaning "the broker connection is gone", as a record's reason carries them.
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,  # refused, reset, broken pipe
    kombu.exceptions.OperationalError,
)

# Celery's consumer (lost, every failed attempt), its connection step (connected), the worker's
# requests (acknowledgements), billiard's pool processes, beat (its own attempts).
CONSUMER_LOGGER = "celery.worker.consumer.consumer"
CONNECTION_LOGGER = "celery.worker.consumer.connection"
REQUEST_LOGGER = "celery.worker.request"
POOL_LOGGER = "multiprocessing"  # billiard.util.LOGGER_NAME
BEAT_LOGGER = "celery.beat"
# SQLAlchemy's pools log on their class's logger (no echo_pool): a connection whose return was cut.
SQLALCHEMY_POOL_LOGGERS = tuple(
    f"sqlalchemy.pool.impl.{name}" for name in ("QueuePool", "NullPool", "SingletonThreadPool", "StaticPool")
)
LOGGERS = (CONSUMER_LOGGER, CONNECTION_LOGGER, REQUEST_LOGGER, POOL_LOGGER, BEAT_LOGGER, *SQLALCHEMY_POOL_LOGGERS)

_SOFT_LIMIT = "Soft time limit (%ss) exceeded for %s[%s]"
_HARD_LIMIT = "Hard time limit (%ss) exceeded for %s[%s]"
_HANDLER_ERROR = "Task handler raised error: %r"
_CANCELLED_KEPT = 1000  # ids of cancelled tasks remembered for their stale time limits
_BEAT_RETRIES = ("beat: Connection error: ", "beat pidbox: Connection error: ")
_ACK_FAILURES = ("Couldn't ack %r, reason:%r", "Couldn't reject %r, reason:%r")
_RESET_FAILED = "Exception during reset or similar"


class BrokerOutageLog(logging.Filter):
    """One process's view of the broker: reachable, or unreachable since when."""

    def __init__(self, clock: Any = time.monotonic, leaving: Callable[[], bool] = soft_limit.leaving) -> None:
        super().__init__()
        self._clock = clock
        self._leaving = leaving
        self._lock = threading.Lock()
        self.unreachable_since: float | None = None
        # Ids of tasks cancelled on a loss, oldest first -> whether their stale soft limit was said.
        self._cancelled: dict[str, bool] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_lost(record):
            with self._lock:
                if self.unreachable_since is None:
                    self.unreachable_since = self._clock()
            return True
        if _is_retry(record):
            with self._lock:
                first = self.unreachable_since is None
                if first:
                    self.unreachable_since = self._clock()
            # Never connected yet (a worker or beat starting while the broker is away): this
            # attempt is the outage's first word.
            return _relevel(record, logging.WARNING if first else logging.INFO)
        if (cancelled := _cancelled_task(record)) is not None:
            with self._lock:
                self._cancelled[cancelled] = False
                while len(self._cancelled) > _CANCELLED_KEPT:
                    del self._cancelled[next(iter(self._cancelled))]
            return _relevel(record, logging.INFO)
        if _is_time_limit(record, _SOFT_LIMIT):
            # Only for a task cancelled on the loss, once: a live task's soft limit is news.
            task_id = _args(record)[2]
            with self._lock:
                stale = self._cancelled.get(task_id) is False
                if stale:
                    self._cancelled[task_id] = True
            return _relevel(record, logging.INFO) if stale else True
        if _is_time_limit(record, _HARD_LIMIT):
            # The same: its process still draining its calls out when the hard limit came.
            with self._lock:
                stale = self._cancelled.pop(_args(record)[2], None) is not None
            return _relevel(record, logging.INFO) if stale else True
        if _is_hard_limit_handler_error(record):
            # Said again, with the task named, by the next record (module docstring).
            return _relevel(record, logging.INFO)
        if _is_ack_failure(record) or _is_stale_soft_limit(record):
            # Side effects of a loss the consumer reports once (above).
            return _relevel(record, logging.INFO)
        if _is_cut_reset(record) and self._leaving():
            # A pool process leaving on Celery's cancel (above): its connection goes with it.
            return _relevel(record, logging.INFO)
        if _is_connected(record):
            with self._lock:
                since, self.unreachable_since = self.unreachable_since, None
            if since is not None:
                record.msg = f"{record.msg} (the broker was unreachable for %.1fs)"
                record.args = (*_args(record), self._clock() - since)
        return True


def _args(record: logging.LogRecord) -> tuple[Any, ...]:
    return record.args if isinstance(record.args, tuple) else ()


def _is_lost(record: logging.LogRecord) -> bool:
    if record.name != CONSUMER_LOGGER:
        return False
    # Imported here: only a worker's consumer logs on this logger, and it has imported it.
    from celery.worker.consumer.consumer import CONNECTION_RETRY

    args = _args(record)
    return record.msg == CONNECTION_RETRY or (bool(args) and args[0] == CONNECTION_RETRY)


def _is_retry(record: logging.LogRecord) -> bool:
    if record.name == CONSUMER_LOGGER:
        from celery.worker.consumer.consumer import CONNECTION_ERROR

        return bool(record.msg == CONNECTION_ERROR)
    return record.name == BEAT_LOGGER and isinstance(record.msg, str) and record.msg.startswith(_BEAT_RETRIES)


def _cancelled_task(record: logging.LogRecord) -> str | None:
    """The id of the task Celery cancels on a connection loss, if that is this record."""
    if record.name != CONSUMER_LOGGER:
        return None
    from celery.worker.consumer.consumer import TERMINATING_TASK_ON_RESTART_AFTER_A_CONNECTION_LOSS as CANCEL

    args = _args(record)
    task_id = getattr(args[0], "id", None) if record.msg == CANCEL and len(args) == 1 else None
    return task_id if isinstance(task_id, str) else None


def _is_time_limit(record: logging.LogRecord, template: str) -> bool:
    return record.name == REQUEST_LOGGER and record.msg == template and len(_args(record)) == 3


def _is_hard_limit_handler_error(record: logging.LogRecord) -> bool:
    args = _args(record)
    return (
        record.name == REQUEST_LOGGER
        and record.msg == _HANDLER_ERROR
        and len(args) == 1
        and isinstance(args[0], TimeLimitExceeded)
    )


def _is_ack_failure(record: logging.LogRecord) -> bool:
    args = _args(record)
    return (
        record.name == REQUEST_LOGGER
        and record.msg in _ACK_FAILURES
        and len(args) == 2
        and isinstance(args[1], CONNECTION_LOST)
    )


def _is_stale_soft_limit(record: logging.LogRecord) -> bool:
    args = _args(record)
    return (
        record.name == POOL_LOGGER
        and record.msg == "Pool process %r error: %r"
        and len(args) == 2
        and isinstance(args[1], SoftTimeLimitExceeded)
        # Raised while the process was already leaving on a signal (billiard's SystemExit on
        # SIGTERM): the task the limit was armed for had ended (done, or stopped by that signal).
        and isinstance(args[1].__context__, SystemExit)
    )


def _is_cut_reset(record: logging.LogRecord) -> bool:
    """The signal cut the reset itself, or cut a statement whose connection then failed its reset
    (SIGTERM inside a psycopg pipeline: the rollback that follows fails, the SystemExit its context)."""
    exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
    if record.name not in SQLALCHEMY_POOL_LOGGERS or record.msg != _RESET_FAILED:
        return False
    for _ in range(3):  # the exception, what it was raised while handling, and that one's
        if exc is None or isinstance(exc, SystemExit | SoftTimeLimitExceeded):
            return exc is not None
        exc = exc.__context__
    return False


def _is_connected(record: logging.LogRecord) -> bool:
    return record.name == CONNECTION_LOGGER and record.msg == "Connected to %s"


def _relevel(record: logging.LogRecord, level: int) -> bool:
    if record.levelno <= level:
        return True
    record.levelno, record.levelname = level, logging.getLevelName(level)
    # Why is in the message; the traceback of a connection refused adds nothing but lines.
    record.exc_info, record.exc_text = None, None
    # The logger let the record through at its old level; at the new one it may not.
    return logging.getLogger(record.name).isEnabledFor(level)


_installed: BrokerOutageLog | None = None
_install_lock = threading.Lock()


def install() -> BrokerOutageLog:
    """Put this process's filter on the loggers above (once; every later call returns it)."""
    global _installed
    with _install_lock:
        if _installed is None:
            _installed = BrokerOutageLog()
            for name in LOGGERS:
                logging.getLogger(name).addFilter(_installed)
        return _installed
