"""The levels a broker outage's records end at (workers/wiring/broker_outage.py), record by record.

The records are made the way Celery, kombu and billiard make them (their loggers, message
templates and arguments); tests/faults/test_broker_outage.py shows the same against real workers
and a real Redis killed under load.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis.exceptions
from billiard.exceptions import SoftTimeLimitExceeded
from celery.worker.consumer.consumer import CONNECTION_ERROR, CONNECTION_RETRY

from workers.wiring.broker_outage import (
    BEAT_LOGGER,
    CONNECTION_LOGGER,
    CONSUMER_LOGGER,
    POOL_LOGGER,
    REQUEST_LOGGER,
    SQLALCHEMY_POOL_LOGGERS,
    BrokerOutageLog,
)

URI = "redis://:**@127.0.0.1:6379/0"
REFUSED = redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(logger: str, level: int, msg: str, *args: Any, exc_info: Any = None) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, level, __file__, 1, msg, args, exc_info)


def lost() -> logging.LogRecord:
    return record(CONSUMER_LOGGER, logging.WARNING, "%s (%r)", CONNECTION_RETRY, REFUSED)


def cannot_connect() -> logging.LogRecord:
    return record(CONSUMER_LOGGER, logging.ERROR, CONNECTION_ERROR, URI, REFUSED, "Trying again in 2.00 seconds...")


def connected() -> logging.LogRecord:
    return record(CONNECTION_LOGGER, logging.INFO, "Connected to %s", URI)


def passed(log: BrokerOutageLog, rec: logging.LogRecord) -> tuple[str, str] | None:
    """(level, message) as a handler would get it, or None if dropped."""
    return (rec.levelname, rec.getMessage()) if log.filter(rec) else None


@pytest.fixture(autouse=True)
def _loggers_at_info() -> Any:
    # A worker started with --loglevel INFO; the filter asks the logger whether INFO is wanted.
    names = (CONSUMER_LOGGER, CONNECTION_LOGGER, REQUEST_LOGGER, POOL_LOGGER, BEAT_LOGGER, *SQLALCHEMY_POOL_LOGGERS)
    before = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.INFO)
    yield
    for n, level in before.items():
        logging.getLogger(n).setLevel(level)


def test_an_outage_is_one_warning_then_info_and_its_end_says_how_long():
    clock = Clock()
    log = BrokerOutageLog(clock)
    assert passed(log, lost())[0] == "WARNING"
    for _ in range(3):
        level, message = passed(log, cannot_connect())
        assert level == "INFO" and message.startswith(f"consumer: Cannot connect to {URI}")
    clock.now += 6.25
    assert passed(log, connected()) == ("INFO", f"Connected to {URI} (the broker was unreachable for 6.2s)")
    # The next outage is reported again.
    assert passed(log, lost())[0] == "WARNING"
    assert passed(log, cannot_connect())[0] == "INFO"


def test_a_worker_starting_without_its_broker_warns_once():
    log = BrokerOutageLog(Clock())
    assert [passed(log, cannot_connect())[0] for _ in range(3)] == ["WARNING", "INFO", "INFO"]
    assert passed(log, connected())[1].endswith("(the broker was unreachable for 0.0s)")
    # A connection without an outage before it is told as Celery tells it.
    assert passed(log, connected()) == ("INFO", f"Connected to {URI}")


def test_a_downgraded_record_is_dropped_where_info_is_not_wanted():
    log = BrokerOutageLog(Clock())
    passed(log, lost())
    logging.getLogger(CONSUMER_LOGGER).setLevel(logging.WARNING)
    assert passed(log, cannot_connect()) is None


def test_an_acknowledgement_lost_with_the_connection_is_info_without_its_traceback():
    log = BrokerOutageLog(Clock())
    try:
        raise REFUSED
    except redis.exceptions.ConnectionError as exc:
        rec = record(REQUEST_LOGGER, logging.CRITICAL, "Couldn't ack %r, reason:%r", "tag-1", exc, exc_info=True)
    assert rec.exc_info is not None
    assert passed(log, rec) == ("INFO", f"Couldn't ack 'tag-1', reason:{REFUSED!r}")
    assert rec.exc_info is None


def test_a_stale_soft_time_limit_in_a_leaving_pool_process_is_info():
    log = BrokerOutageLog(Clock())
    try:
        try:
            raise SystemExit(-241)  # billiard's SIGTERM handler: the process is leaving
        except SystemExit:
            raise SoftTimeLimitExceeded()  # noqa: B904 - implicit context, as billiard raises it
    except SoftTimeLimitExceeded as exc:
        rec = record(POOL_LOGGER, logging.ERROR, "Pool process %r error: %r", "<Worker>", exc, exc_info=True)
    assert passed(log, rec)[0] == "INFO"


def test_beat_warns_once_per_outage_too():
    log = BrokerOutageLog(Clock())
    beat = "beat: Connection error: %s. Trying again in %s seconds..."
    levels = [passed(log, record(BEAT_LOGGER, logging.ERROR, beat, REFUSED, 2))[0] for _ in range(2)]
    assert levels == ["WARNING", "INFO"]


@pytest.mark.parametrize(
    "rec",
    [
        # Final or unrelated: they keep their level.
        record(CONSUMER_LOGGER, logging.ERROR, "Received unregistered task of type %s.", "x"),
        record(REQUEST_LOGGER, logging.CRITICAL, "Couldn't ack %r, reason:%r", "tag-1", ValueError("bug")),
        record(REQUEST_LOGGER, logging.ERROR, "Task handler raised error: %r", REFUSED),
        record(POOL_LOGGER, logging.ERROR, "Pool process %r error: %r", "<Worker>", SoftTimeLimitExceeded()),
        record(POOL_LOGGER, logging.ERROR, "Pool process %r error: %r", "<Worker>", ValueError("bug")),
        record(BEAT_LOGGER, logging.ERROR, "Message Error: %s\n%s", REFUSED, "stack"),
        record("workers.reconcile.batch", logging.ERROR, "failed_before_commit: %s", "rejected"),
    ],
    ids=lambda r: r.getMessage()[:40],
)
def test_every_other_record_passes_unchanged(rec: logging.LogRecord):
    log = BrokerOutageLog(Clock())
    passed(log, lost())  # even during an outage
    level = rec.levelname
    assert passed(log, rec) == (level, rec.getMessage())


class Request:
    """What Celery passes to its cancel warning: the request, whose id names the task."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id

    def __str__(self) -> str:
        return f"outbox.reconcile[{self.id}]"


def test_a_task_cancelled_on_the_loss_is_info_and_so_is_its_stale_soft_limit():
    from celery.worker.consumer.consumer import TERMINATING_TASK_ON_RESTART_AFTER_A_CONNECTION_LOSS as CANCEL

    log = BrokerOutageLog(Clock())
    passed(log, lost())
    assert passed(log, record(CONSUMER_LOGGER, logging.WARNING, CANCEL, Request("t-1")))[0] == "INFO"
    soft = "Soft time limit (%ss) exceeded for %s[%s]"
    assert passed(log, record(REQUEST_LOGGER, logging.WARNING, soft, 2.0, "outbox.reconcile", "t-1"))[0] == "INFO"
    # Once: a later run of the same task, and any other task, is news.
    assert passed(log, record(REQUEST_LOGGER, logging.WARNING, soft, 2.0, "outbox.reconcile", "t-1"))[0] == "WARNING"
    assert passed(log, record(REQUEST_LOGGER, logging.WARNING, soft, 2.0, "outbox.dispatch", "t-2"))[0] == "WARNING"


def test_the_hard_limit_of_a_task_cancelled_on_the_loss_is_info_and_of_a_task_at_work_one_error():
    """A task Celery cancelled on the loss whose process was still draining its calls out at the hard
    limit (CI, 2026-12-07): its hard limit is part of the outage. Celery says every hard limit twice;
    the record without the task's name is INFO, the one with it keeps the event's level."""
    from billiard.exceptions import TimeLimitExceeded
    from celery.worker.consumer.consumer import TERMINATING_TASK_ON_RESTART_AFTER_A_CONNECTION_LOSS as CANCEL

    log = BrokerOutageLog(Clock())
    passed(log, lost())
    passed(log, record(CONSUMER_LOGGER, logging.WARNING, CANCEL, Request("t-1")))
    soft = "Soft time limit (%ss) exceeded for %s[%s]"
    hard = "Hard time limit (%ss) exceeded for %s[%s]"
    handler = "Task handler raised error: %r"
    assert passed(log, record(REQUEST_LOGGER, logging.WARNING, soft, 2.0, "outbox.reconcile", "t-1"))[0] == "INFO"
    assert passed(log, record(REQUEST_LOGGER, logging.ERROR, handler, TimeLimitExceeded(2.5)))[0] == "INFO"
    assert passed(log, record(REQUEST_LOGGER, logging.ERROR, hard, 2.5, "outbox.reconcile", "t-1"))[0] == "INFO"
    # A task at work, or the same task run again: its hard limit is news, said once at ERROR.
    assert passed(log, record(REQUEST_LOGGER, logging.ERROR, handler, TimeLimitExceeded(2.5)))[0] == "INFO"
    assert passed(log, record(REQUEST_LOGGER, logging.ERROR, hard, 2.5, "outbox.reconcile", "t-1"))[0] == "ERROR"
    assert passed(log, record(REQUEST_LOGGER, logging.ERROR, hard, 2.5, "outbox.dispatch", "t-2"))[0] == "ERROR"


def _cut_reset(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001 - SQLAlchemy logs whatever cut the reset
        return record(
            SQLALCHEMY_POOL_LOGGERS[0],
            logging.ERROR,
            "Exception during reset or similar",
            exc_info=(type(raised), raised, raised.__traceback__),
        )


def test_a_connection_reset_cut_by_the_process_leaving_is_info_and_otherwise_news():
    leaving = BrokerOutageLog(Clock(), leaving=lambda: True)
    assert passed(leaving, _cut_reset(SystemExit(-241)))[0] == "INFO"
    assert passed(leaving, _cut_reset(SoftTimeLimitExceeded()))[0] == "INFO"
    # A process at work: a reset cut by its own soft limit, or any other failure, stays an ERROR.
    at_work = BrokerOutageLog(Clock(), leaving=lambda: False)
    assert passed(at_work, _cut_reset(SoftTimeLimitExceeded()))[0] == "ERROR"
    assert passed(leaving, _cut_reset(OSError("connection reset")))[0] == "ERROR"


def _failed_after(signal_exit: BaseException) -> BaseException:
    """What the reset raises when the signal cut a statement first (CI, 2026-12-07: SIGTERM inside a
    psycopg pipeline's exit, then the pool's rollback failed with the SystemExit as its context)."""
    try:
        try:
            raise signal_exit
        except BaseException:  # noqa: BLE001 - as SQLAlchemy's reset runs while it propagates
            raise OSError("the pipeline was cut")  # noqa: B904 - the context is the point
    except OSError as failed:
        return failed


def test_a_reset_that_failed_because_the_signal_cut_its_statement_is_info_when_leaving():
    leaving = BrokerOutageLog(Clock(), leaving=lambda: True)
    assert passed(leaving, _cut_reset(_failed_after(SystemExit(-241))))[0] == "INFO"
    at_work = BrokerOutageLog(Clock(), leaving=lambda: False)
    assert passed(at_work, _cut_reset(_failed_after(SystemExit(-241))))[0] == "ERROR"


def test_a_cut_reset_relevelled_to_info_is_dropped_at_sqlalchemys_own_level():
    pool_logger = logging.getLogger(SQLALCHEMY_POOL_LOGGERS[0])
    before = pool_logger.level
    pool_logger.setLevel(logging.NOTSET)  # as SQLAlchemy leaves it: "sqlalchemy" at WARNING
    sqlalchemy_logger = logging.getLogger("sqlalchemy")
    was = sqlalchemy_logger.level
    sqlalchemy_logger.setLevel(logging.WARNING)
    try:
        assert passed(BrokerOutageLog(Clock(), leaving=lambda: True), _cut_reset(SystemExit(-241))) is None
    finally:
        pool_logger.setLevel(before)
        sqlalchemy_logger.setLevel(was)
