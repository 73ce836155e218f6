"""Where one dispatch's time goes: ``Dispatcher.dispatch`` in-process under cProfile, no Celery.

Throwaway database + ``python -m workers.sandbox`` subprocess; N intents submitted first, then each is
dispatched in this process exactly as a worker's task body would (``get_runtime().dispatcher`` +
``dispatch``, ``--batch`` ids per doorbell). Prints wall time per operation and the top functions by cumulative time.
``--threads``: every thread profiled (the calls run on threads of their own, the finalize on the
committer's), each timed by its own CPU, so the figures are CPU per function, not waits.

    .venv/bin/python -m bench.dispatch_profile [--ops 200] [--threads [--callers REGEX]]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import yaml


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--batch", type=int, default=1, help="ids per doorbell (Dispatcher.dispatch)")
    p.add_argument(
        "--reconcile",
        action="store_true",
        help="profile the reconciler instead: every call answers 504 after committing, then each "
        "operation is looked up (Reconciler.reconcile, --batch ids per doorbell) and found",
    )
    p.add_argument(
        "--lookup-latency-ms",
        type=float,
        default=0.0,
        help="with --reconcile: every lookup takes this long at the sandbox (a real provider's search)",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="no cProfile: report this process's CPU per operation (all its threads)",
    )
    p.add_argument(
        "--task-events",
        choices=("off", "on", "both"),
        default="off",
        help="each call's Celery task events (workers/engine/call_events.py) sent, to a consumer standing in for "
        "Flower (bench/event_sink.py); both: off and on in turn, --rounds times each (the order alternating), "
        "and CPU per operation of each (implies --no-profile)",
    )
    p.add_argument("--rounds", type=int, default=6, help="with --task-events both: rounds of off and on")
    p.add_argument(
        "--threads",
        action="store_true",
        help="profile every thread (the call threads and the committer too), timed by each thread's CPU "
        "(time.thread_time), not the wall clock: where the CPU per operation goes",
    )
    p.add_argument("--callers", help="also print who calls the functions matching this regular expression")
    args = p.parse_args(argv)
    if args.task_events == "both":
        args.no_profile = True
    profiles: list[cProfile.Profile] = []
    if args.threads and not args.no_profile:
        _profile_threads(profiles)
    from bench.pipeline_bench import REDIS_URL, actions_doc
    from bench.scratch_database import ScratchDatabase
    from workers.sandbox.testing import SandboxProcess

    prefix = f"bench-dprof-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(REDIS_URL)
    try:
        with tempfile.TemporaryDirectory() as tmp, ScratchDatabase() as db, SandboxProcess() as sandbox:
            actions = Path(tmp) / "actions.yaml"
            actions.write_text(yaml.safe_dump(actions_doc(sandbox.url), sort_keys=False))
            os.environ.update(
                {
                    "OUTBOX_DATABASE_URL": db.url,
                    "OUTBOX_BROKER_URL": REDIS_URL,
                    "OUTBOX_REDIS_URL": REDIS_URL,
                    "OUTBOX_BROKER_KEY_PREFIX": prefix,
                    "OUTBOX_ACTIONS_FILE": str(actions),
                    "OUTBOX_DATA_DIR": str(Path(tmp) / "data"),
                }
            )
            from producer import submit
            from workers.wiring.runtime import get_runtime

            rt = get_runtime()
            ids = []
            for i in range(10 if args.task_events == "both" else args.ops + 10):
                with rt.sessions.begin() as s:
                    ids.append(
                        submit(
                            s,
                            tenant="prof",
                            idempotency_key=f"k{i}",
                            action="payments.refund.create",
                            args={"order_id": "o", "amount": "12.50", "currency": "EUR"},
                            subject="bench",
                        ).operation_id
                    )
            for op_id in ids[:10]:  # warm-up
                rt.dispatcher.dispatch_one(op_id)
            work, what = rt.dispatcher.dispatch, "dispatches"
            if args.reconcile:
                sandbox.add_fault(mode="commit_then_504", probability=1.0, method="POST")
                if args.lookup_latency_ms:
                    sandbox.add_fault(mode="latency", latency_ms=args.lookup_latency_ms, method="GET")
                for i in range(10, len(ids), 10):
                    rt.dispatcher.dispatch(ids[i : i + 10])
                work, what = rt.reconciler.reconcile, "lookups"
            sink = None
            if args.task_events != "off":
                from bench.pipeline_bench import EventSink
                from workers.ground import event_sender
                from workers.wiring.celery_app import make_app

                sink = EventSink(dict(os.environ), Path(tmp)).start()
                event_sender.install(make_app(), "bench@dispatch_profile", task_events=True)
            if args.task_events == "both":

                def submit_n(n: int, tag: str) -> list[str]:
                    with rt.sessions.begin() as s:
                        return [
                            submit(
                                s,
                                tenant="prof",
                                idempotency_key=f"{tag}-{i}",
                                action="payments.refund.create",
                                args={"order_id": "o", "amount": "12.50", "currency": "EUR"},
                                subject="bench",
                            ).operation_id
                            for i in range(n)
                        ]

                _both(work, submit_n, args.ops // (2 * args.rounds), args.batch, args.rounds)
                rt.close()
                if sink is not None:
                    print(f"events taken in by the consumer: {sink.stop()}")
                return 0
            prof = cProfile.Profile(time.thread_time) if args.threads else cProfile.Profile()
            started, cpu_started = time.perf_counter(), time.process_time()
            if not args.no_profile:
                prof.enable()
            rest = ids[10:]
            for i in range(0, len(rest), args.batch):
                work(rest[i : i + args.batch])
            prof.disable()
            if sink is not None:
                event_sender.flush()  # the sender's work for these calls, inside the measure
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            done = args.ops
            if args.reconcile:  # only what was looked up: a breaker opened by the 504s leaves some unsent
                from sqlalchemy import func, select

                from outbox.ledger.models import Attempt

                with rt.sessions() as s:
                    done = s.execute(select(func.count()).where(Attempt.kind == "lookup")).scalar_one()
            print(
                f"{done} {what} in-process: {wall / done * 1000:.2f} ms each "
                f"({done / wall:.0f}/s in one process), CPU {cpu / done * 1000:.2f} ms each; "
                f"effects {len(sandbox.effects())}"
            )
            rt.close()
            if not args.no_profile:
                stats = pstats.Stats(prof)
                for other in profiles:  # the threads', complete once rt.close() has ended them
                    stats.add(other)
                stats.sort_stats(os.environ.get("PROFILE_SORT", "cumulative")).print_stats(args.top)
                if args.callers:
                    stats.print_callers(args.callers)
            if sink is not None:
                print(f"events taken in by the consumer: {sink.stop()}")
    finally:
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000)) + list(
            r.scan_iter(match=f"agent-outbox:breaker:{prefix}*", count=1000)
        )
        if keys:
            r.delete(*keys)
    return 0


def _profile_threads(profiles: list[cProfile.Profile]) -> None:
    """Every thread started from here on runs under a profiler of its own, timed by its CPU."""
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        profiles.append(prof)
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled  # type: ignore[method-assign]


def _both(work: Any, submit_n: Any, per: int, batch: int, rounds: int) -> None:
    """Events off and on in turn over the same process, database and sandbox: CPU per operation of
    this process (every thread: the call threads, the finalizer, the events' sender) for each. Each
    turn dispatches ``per`` intents submitted just before it (a doorbell claims whatever is due:
    intents of the next turn would be taken along)."""
    import statistics

    from workers.ground import event_sender

    cpu: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            chunk = submit_n(per, f"r{r}-{on}")
            event_sender.set_on(on)
            started = time.process_time()
            for i in range(0, len(chunk), batch):
                work(chunk[i : i + batch])
            event_sender.flush()
            cpu[on].append((time.process_time() - started) / len(chunk) * 1000)
    off, on_ = statistics.median(cpu[False]), statistics.median(cpu[True])
    pairs = [f"{b / a - 1:+.1%}" for a, b in zip(cpu[False], cpu[True])]
    print(
        f"{per} operations x {rounds} rounds each, batch {batch}: CPU ms per operation, events off "
        f"{off:.3f} [{min(cpu[False]):.3f}-{max(cpu[False]):.3f}], on {on_:.3f} [{min(cpu[True]):.3f}-"
        f"{max(cpu[True]):.3f}]: on costs {on_ / off - 1:+.1%} (per round: {', '.join(pairs)})"
    )


if __name__ == "__main__":
    sys.exit(main())
