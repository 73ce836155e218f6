"""A doorbell rung after a commit: the commit is what counts, a broker outage is no failure of it."""

from __future__ import annotations

import logging
import socket

import pytest
from celery import Celery

from workers.engine.doorbell import Doorbell


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def unreachable_broker() -> Celery:
    app = Celery("doorbell-test", broker=f"redis://127.0.0.1:{_closed_port()}/0")
    app.conf.task_publish_retry = False
    app.conf.broker_connection_retry = False
    app.conf.broker_connection_timeout = 0.5
    return app


def test_a_doorbell_after_commit_with_the_broker_away_is_info_not_an_exception(unreachable_broker, caplog):
    """Under a Redis outage a reconciler's settlement committed "send again" and then its doorbell
    raised: the task logged "settling lookups interrupted by an outage" (a WARNING per settlement,
    saying the operations would be looked up again, which they would not: they were due and the
    relay re-publishes them). tests/faults/test_broker_outage.py caught it under load."""
    bell = Doorbell(unreachable_broker)
    with pytest.raises(Exception):  # noqa: B017 - the plain ring still says the broker is away
        bell.ring_dispatch(["op-1"])
    caplog.set_level(logging.INFO, logger="workers.engine.doorbell")
    bell.ring_dispatch_after_commit(["op-1", "op-2"])
    records = [r for r in caplog.records if r.name == "workers.engine.doorbell"]
    assert [(r.levelname, r.getMessage()) for r in records][-1][0] == "INFO"
    assert "2 operation(s) not rung" in records[-1].getMessage()
    assert records[-1].operation_ids == ["op-1", "op-2"]


def test_a_doorbell_shows_its_ids_as_celery_would_without_its_saferepr():
    """Flower and the worker's log show a message's arguments as text. The relay writes it as a plain
    repr (Celery's saferepr cost ~40 us a doorbell), cut at Celery's length: the same text for a
    doorbell of a few ids, and a long one still cut."""
    from celery.utils.saferepr import saferepr
    from kombu import Queue

    from workers.engine.queues import DISPATCH_QUEUE

    app = Celery("doorbell-test", broker="memory://")
    ids = [f"00000000-0000-4000-8000-{i:012d}" for i in range(101)]
    Doorbell(app, batch=100).ring_dispatch(ids)
    shown = []
    with app.connection() as conn:
        with conn.SimpleQueue(Queue(DISPATCH_QUEUE, routing_key=DISPATCH_QUEUE)) as queue:
            for _ in range(2):
                message = queue.get(timeout=1)
                shown.append((message.headers["argsrepr"], message.headers["kwargsrepr"]))
                message.ack()
    (long, kwargs), (short, _) = shown  # 101 ids: a doorbell of 100 and one of 1
    assert kwargs == saferepr({}) == "{}"
    assert short == saferepr([ids[100]], 1024) == repr([ids[100]])
    assert len(long) == 1024 and long.startswith(repr([ids[:100]])[:1021]) and long.endswith("...")
