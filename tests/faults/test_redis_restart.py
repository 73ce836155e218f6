"""F12: the broker (Redis) is SIGKILLed with doorbells queued and restarts empty; no intent is lost.

The test runs its own redis-server (never the shared one on 6379): the relay publishes, nobody
consumes, Redis dies and comes back without persistence, and only then do workers start. The relay
reads the queue's depth before it rings: an empty broker holds none of the doorbells it rang, so it
rings the due rows again at once, long before republish_after_s (which only serves where the depth
cannot be read). Every intent must come to an end, once.
"""

from __future__ import annotations

from collections import Counter

import pytest

from outbox.ledger.states import Status
from tests.harness import pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

N = 20


def test_redis_killed_with_doorbells_queued_loses_no_intent(private_redis, pipe, sandbox):
    pipe.env["OUTBOX_BROKER_URL"] = private_redis.url
    pipe.env["OUTBOX_REDIS_URL"] = private_redis.url
    queue = pipe.env["OUTBOX_BROKER_KEY_PREFIX"] + "dispatch"
    keys = [f"f12-{i:02d}" for i in range(N)]
    op_ids = [pipe.submit(k).operation_id for k in keys]

    # Never passes during the test: the empty queue, not the clock, is what re-rings them.
    pipe.start_relay(republish_after_s=600.0)  # no worker yet: the doorbells pile up in Redis

    # One doorbell carries up to OUTBOX_DOORBELL_BATCH ids.
    messages = -(-N // pipe.settings().doorbell_batch)

    # The relay rings by count (it reads the queue's depth), so nothing marks the rows: what shows
    # the doorbells rung is the queue itself.
    def published() -> bool:
        return private_redis.client().llen(queue) >= messages

    wait_for(published, 10, what=f"{N} intents' doorbells ({messages} messages) queued in the private Redis")

    before = private_redis.client().info("server")["run_id"]
    private_redis.kill()
    private_redis.start()  # same port, empty: no RDB, no AOF
    # The relay may already have rung again into the new server (that is the behaviour under test),
    # so the queue's depth proves nothing here: what proves the loss is a new server that loaded nothing.
    after = private_redis.client()
    assert after.info("server")["run_id"] != before, "Redis must have been restarted"
    assert after.info("persistence")["rdb_last_load_keys_loaded"] == 0, "the restarted Redis must have lost the queue"

    pipe.start_worker("w1")
    pipe.start_worker("w2")
    wait_for(
        lambda: pipe.count(Status.SUCCEEDED.value) == N,
        30,
        what=lambda: f"all {N} intents succeeded (now {pipe.count(Status.SUCCEEDED.value)})",
    )

    assert {pipe.op(i).status for i in op_ids} == {Status.SUCCEEDED.value}
    effects = sandbox.effects()
    assert Counter(e["idempotency_key"] for e in effects) == Counter(pk(k) for k in keys)  # one effect per key
    assert sandbox.duplicates() == []
