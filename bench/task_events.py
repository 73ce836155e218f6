"""What each call's task events cost a worker, part by part, in-process: the hooks on the call
threads (workers/engine/call_events.py: three events built and queued per operation) and the
sender's publish (workers/ground/event_sender.py: celery.events.Dispatcher, JSON, one message per
batch). CPU time of this thread, so less sensitive than throughput to what else the machine runs.
Needs Redis (OUTBOX_BENCH_REDIS_URL, default the local one); publishes under a key prefix of its own.

    .venv/bin/python -m bench.task_events [--ops 3000] [--repeats 7] [--batch 300]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
import uuid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=300, help="events per published message")
    args = p.parse_args(argv)
    prefix = f"bench-events-{uuid.uuid4().hex[:8]}:"
    os.environ.update(
        {
            "OUTBOX_BROKER_URL": os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
            "OUTBOX_BROKER_KEY_PREFIX": prefix,
            "OUTBOX_DATA_DIR": tempfile.mkdtemp(prefix="bench-events-"),
        }
    )
    from outbox.ledger.claims import Claim
    from outbox.ledger.states import AttemptKind, Status
    from workers.engine import call_events
    from workers.engine.outcomes import Succeeded
    from workers.ground import event_sender
    from workers.wiring.celery_app import make_app

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    claim = Claim(
        operation_id=str(uuid.uuid4()),
        fencing_token=1,
        attempt_id=1,
        attempt_number=1,
        kind=AttemptKind.DISPATCH,
        tenant="t1",
        idempotency_key="k",
        action="payments.refund.create",
        args=json.dumps({"order_id": "o-1", "amount": "12.50", "currency": "EUR", "reason": "bench"}),
        args_digest="d",
        subject="s",
        worker="w",
        lease_expires_at=t0,
        max_attempts=None,
        attempt_count=1,
        deadline_at=None,
        created_at=t0,
        cancel_requested=False,
        open_ambiguity=False,
    )
    applied = [(claim, Succeeded("re_1", {"id": "re_1"}), Status.SUCCEEDED, "provider confirmed", {"latency_s": 0.01})]
    event_sender.install(make_app(), "bench@task_events", task_events=True)
    sender = event_sender._start_sender()
    hooks, publish = [], []
    for _ in range(args.repeats):
        with sender._lock:  # the sender's thread waits: this thread does and times both parts
            started = time.thread_time()
            for _ in range(args.ops):  # one clean call: claimed, sent, succeeded
                call_events.claimed([claim])
                call_events.sending(claim)
                call_events.dispatched(applied)
            hooks.append((time.thread_time() - started) / args.ops * 1e6)
            batch = list(sender.queued)
            sender.queued.clear()
            started = time.thread_time()
            for i in range(0, len(batch), args.batch):
                sender._publish(batch[i : i + args.batch])
            publish.append((time.thread_time() - started) / args.ops * 1e6)
    for name, values in (("hooks on the call threads", hooks), ("the sender's publish", publish)):
        print(
            f"{name}: {statistics.median(values):.1f} us CPU per operation "
            f"[{min(values):.1f}-{max(values):.1f}] ({args.repeats} x {args.ops} operations, 3 events each)"
        )
    import redis

    r = redis.Redis.from_url(os.environ["OUTBOX_BROKER_URL"])
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
