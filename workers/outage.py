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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import kombu.exceptions
import psycopg
import redis.exceptions
import sqlalchemy.exc

log = logging.getLogger(__name__)

OUTAGES: tuple[type[BaseException], ...] = (
    sqlalchemy.exc.OperationalError,  # connection refused or lost, "the database system is shutting down"
    sqlalchemy.exc.InterfaceError,  # a connection that was already closed
    psycopg.OperationalError,  # the same, on a worker's own autocommit connection (ledger_connection.py)
    psycopg.InterfaceError,
    redis.exceptions.ConnectionError,  # doorbells to a broker that is away
    redis.exceptions.TimeoutError,
    kombu.exceptions.OperationalError,
)


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
