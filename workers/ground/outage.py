"""Outages of the ledger or the broker: not failures of the operations a task was handling.

A PostgreSQL restart, a dropped connection or a broker blip makes a dispatch or reconcile task
fail part-way. Nothing is lost and nothing needs a person: an operation the task had claimed comes
back through lease expiry (outcome_unknown, then the reconciler asks the provider), one it had not
claimed through the relay's re-publishing of unacted doorbells. So the task logs one WARNING that
names the operations and how they recover, and returns: raising would put a traceback into
Celery's error log for every such task, and ERROR is for final failures only (DESIGN.md). Any other
exception is a bug and still raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import kombu.exceptions
import redis.exceptions
import sqlalchemy.exc

log = logging.getLogger(__name__)


def _psycopg_outages() -> tuple[type[Exception], ...]:
    """A worker's own autocommit connection (outbox/ledger/hot_path.py) raises psycopg's errors
    unwrapped. Without a psycopg implementation the ledger is SQLite, and there is no such connection."""
    try:
        import psycopg
    except ImportError:
        return ()
    return (psycopg.OperationalError, psycopg.InterfaceError)


# Doorbells to a broker that is away.
BROKER_OUTAGES: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    kombu.exceptions.OperationalError,
)
# The ledger's database away or refusing for now.
LEDGER_OUTAGES: tuple[type[Exception], ...] = (
    sqlalchemy.exc.OperationalError,  # connection refused or lost, "the database system is shutting down"
    sqlalchemy.exc.InterfaceError,  # a connection that was already closed
    *_psycopg_outages(),  # the same, on a worker's own autocommit connection
)
OUTAGES: tuple[type[BaseException], ...] = (*LEDGER_OUTAGES, *BROKER_OUTAGES)


@contextmanager
def riding_out_outages(task: str, operation_ids: Sequence[str]) -> Iterator[None]:
    """Run a task body; an outage becomes one WARNING naming ``operation_ids``, not an exception."""
    try:
        yield
    except OUTAGES as exc:
        log.warning(
            "%s interrupted by an outage (%s: %s); claimed operations come back through lease expiry and "
            "the reconciler, unclaimed ones through the relay's re-publishing",
            task,
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            extra={"operation_ids": list(operation_ids)},
        )


class OutageReport:
    """What a loop that retries through an outage says: one WARNING, not one per attempt.

    The first failed attempt of an outage is its WARNING (with the traceback); the next ones are
    INFO, one line each (retried failures are INFO, STYLE.md); a success ``quiet_s`` after the last
    failure says, at INFO, that the outage is over and how long it lasted. Only for OUTAGES: any
    other exception is a bug, and the caller keeps warning about it every time.
    """

    def __init__(
        self,
        logger: logging.Logger,
        who: str,
        *,
        quiet_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # quiet_s: one success does not end an outage; a relay tick with nothing to publish
        # succeeds while the broker is still away, and the next one fails again.
        self._log, self._who, self._quiet_s, self._clock = logger, who, quiet_s, clock
        self._lock = threading.Lock()  # the relay's ticks and its listener share one
        self._since: float | None = None
        self._last_failure = 0.0
        self._failures = 0

    def failed(self, exc: BaseException, msg: str, *args: Any) -> None:
        with self._lock:
            first = self._since is None
            self._last_failure = self._clock()
            if first:
                self._since = self._last_failure
            self._failures += 1
        if first:
            self._log.warning(msg, *args, exc_info=exc)
        else:
            self._log.info(f"{msg} ({type(exc).__name__}: %s)", *args, _first_line(exc))

    def succeeded(self) -> None:
        with self._lock:
            since, now = self._since, self._clock()
            if since is None or now - self._last_failure < self._quiet_s:
                return
            failures, self._since, self._failures = self._failures, None, 0
        self._log.info(
            "%s: outage over (attempts failed for %.1fs, %d in all)", self._who, self._last_failure - since, failures
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
