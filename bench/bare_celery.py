"""Bare Celery: the baseline for the pipeline benchmark, on the same broker as the outbox.

A no-op task that INCRs a Redis counter (so the benchmark can see it executed), with the settings
the outbox's app uses where they cost something per message: JSON, acks_late, prefetch 1, results
ignored. Configured from the environment so worker processes build the same app:
``BENCH_BARE_BROKER_URL``, ``BENCH_BARE_PREFIX`` (kombu ``global_keyprefix`` and the counter's key
prefix), ``BENCH_BARE_EVENTS=1`` to also send task events as the outbox's app does.

    celery -A bench.bare_celery worker -P prefork -c 2 ...
"""

from __future__ import annotations

import os

import redis
from celery import Celery

BROKER_URL = os.environ.get("BENCH_BARE_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_BARE_PREFIX", "bench-bare:")
EVENTS = os.environ.get("BENCH_BARE_EVENTS") == "1"
QUEUE = "bare"


def baseline_conf(broker_url: str, prefix: str, queue: str) -> dict[str, object]:
    """The settings every baseline shares with the outbox's app where they cost something per
    message (bench/naive_pipeline.py uses them too): JSON, acks_late, prefetch 1, no results."""
    return {
        "broker_url": broker_url,
        "broker_transport_options": {"global_keyprefix": prefix, "visibility_timeout": 3600},
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": queue,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
    }


app = Celery("bench_bare", set_as_current=False)
app.conf.update(**baseline_conf(BROKER_URL, PREFIX, QUEUE), worker_send_task_events=EVENTS, task_send_sent_event=EVENTS)

_redis: redis.Redis | None = None


def counter_key() -> str:
    return f"{PREFIX}executed"


@app.task(name="bench.noop", ignore_result=True)
def noop(i: int) -> None:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(BROKER_URL)
    _redis.incr(counter_key())
