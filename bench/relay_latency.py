"""The relay's commit-to-publish latency, LISTEN/NOTIFY vs polling, on PostgreSQL.

The relay runs in a thread of this process against a throwaway database and the real Redis broker
(its own key prefix, deleted afterwards; no worker consumes, the doorbells are just counted, and
the queue reads as empty: a free worker's view). The
main thread submits one intent per transaction, spaced ``--gap-ms`` apart, and notes
``time.perf_counter()`` when COMMIT returns; a ``Doorbell`` subclass notes the time when
``ring_dispatch`` has published each operation id. Latency = published - committed. Nothing in
``workers/`` is changed: polling is forced with a ``Relay`` subclass that calls ``_poll_loop``.

Modes: ``listen`` (``run_forever`` on PostgreSQL: doorbells rung from the NOTIFY payloads, ticks
every 0.5 s as the backstop), ``poll-0.5`` and ``poll-0.05`` (ticks only).

    .venv/bin/python -m bench.relay_latency [--quick] [--samples 300] [--repeats 3]

Writes bench/results/relay-latency-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import redis

from bench.scratch_database import ScratchDatabase
from outbox.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
ARGS = {"order_id": "ord-bench", "amount": "12.50", "currency": "EUR"}


def _classes() -> dict[str, Any]:
    from workers.engine.doorbell import Doorbell
    from workers.relay.loop import Relay

    class RecordingDoorbell(Doorbell):
        """Notes when each operation id has been published (after send_task returned)."""

        def __init__(self, app: Any, batch: int) -> None:
            super().__init__(app, batch=batch)
            self.published: dict[str, float] = {}
            self.rings: list[float] = []

        def queued_dispatch(self) -> int | None:
            # As if a free worker took each doorbell at once (none consumes here): the broker's
            # growing queue would otherwise read as "every worker busy", and the relay would hold
            # ids for fuller doorbells (workers/relay/gather.py), or run out of room at
            # OUTBOX_RELAY_MAX_QUEUED; what is measured is the relay's latency to a free worker.
            return 0

        def ring_dispatch(self, operation_ids: Iterable[str]) -> int:
            ids = list(operation_ids)
            n = super().ring_dispatch(ids)
            now = time.perf_counter()
            self.rings.append(now)
            for op_id in ids:
                self.published.setdefault(op_id, now)
            return n

    class PollingRelay(Relay):
        def run_forever(self) -> None:
            self._poll_loop()

    return dict(RecordingDoorbell=RecordingDoorbell, Relay=Relay, PollingRelay=PollingRelay)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


def measure(
    db_url: str, prefix: str, mode: str, samples: int, gap_s: float, batch: int = 1, linger_s: float | None = None
) -> dict[str, Any]:
    from outbox.ledger.db import make_engine, make_sessionmaker
    from producer import submit
    from workers.wiring.celery_app import make_app

    c = _classes()
    settings = Settings(database_url=db_url, broker_url=REDIS_URL, broker_key_prefix=prefix)
    doorbell = c["RecordingDoorbell"](make_app(settings), batch)
    relay_engine = make_engine(db_url)
    cls = {"listen": c["Relay"], "poll-0.5": c["PollingRelay"], "poll-0.05": c["PollingRelay"]}[mode]
    poll_s = 0.05 if mode == "poll-0.05" else 0.5
    linger = settings.relay_linger_s if linger_s is None else linger_s
    relay = cls(relay_engine, doorbell, poll_s=poll_s, linger_s=linger)
    thread = threading.Thread(target=relay.run_forever, name="relay", daemon=True)
    engine = make_engine(db_url, pool_size=1)
    sessions = make_sessionmaker(engine)
    tenant = f"lat-{uuid.uuid4().hex[:8]}"
    committed: dict[str, float] = {}
    try:
        thread.start()
        time.sleep(0.3)  # LISTEN is set up, first tick done
        for i in range(-10, samples):  # 10 warm-up submits (connections, statement caches)
            with sessions.begin() as s:
                receipt = submit(
                    s,
                    tenant=tenant,
                    idempotency_key=f"k{i}",
                    action="payments.refund.create",
                    args=ARGS,
                    subject="bench",
                )
            t = time.perf_counter()
            if i >= 0:
                committed[receipt.operation_id] = t
            time.sleep(gap_s)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
            all(k in doorbell.published for k in committed)
            if mode == "listen"
            else doorbell.rings and doorbell.rings[-1] >= max(committed.values())
        ):
            time.sleep(0.01)
    finally:
        relay.stop()
        thread.join(10)
        relay_engine.dispose()
        engine.dispose()
    if mode == "listen":  # the leader rings the notified ids themselves
        lat = [(doorbell.published[k] - t) * 1000 for k, t in committed.items() if k in doorbell.published]
    else:
        # A tick rings as many doorbells as the due rows need, for the OLDEST due rows (a doorbell's
        # claim takes whatever is due): nothing consumes here, so a commit's latency is the wait
        # for the first doorbell rung after it.
        lat = [
            (min(r for r in doorbell.rings if r >= t) - t) * 1000
            for t in committed.values()
            if doorbell.rings and doorbell.rings[-1] >= t
        ]
    out: dict[str, Any] = {
        "mode": mode,
        "samples": len(lat),
        "missing": samples - len(lat),
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "max_ms": max(lat),
        "mean_ms": statistics.fmean(lat),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 samples, one run, listen + poll-0.05")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--gap-ms", type=float, default=15)
    p.add_argument("--modes", default=None)
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="ids per doorbell (default 1: every id published alone, the linger never holds one; "
        f"deployed, OUTBOX_DOORBELL_BATCH, {Settings.model_fields['doorbell_batch'].default}: "
        "ids notified within the linger are gathered)",
    )
    p.add_argument("--linger-ms", type=float, default=None, help="the relay's linger (default OUTBOX_RELAY_LINGER_S's)")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch: at least 1 id per doorbell")
    if args.linger_ms is not None and args.linger_ms < 0:
        p.error("--linger-ms: 0 or more")
    samples = args.samples or (60 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick else 3)
    modes = (
        args.modes.split(",")
        if args.modes
        else (["listen", "poll-0.05"] if args.quick else ["listen", "poll-0.5", "poll-0.05"])
    )
    prefix = f"bench-relay-{uuid.uuid4().hex[:8]}:"
    r = redis.Redis.from_url(REDIS_URL)
    runs: list[dict[str, Any]] = []
    try:
        with ScratchDatabase() as db:
            from bench.pipeline_bench import environment

            env = environment(db)
            for rep in range(repeats):
                for mode in modes:
                    # A queue of its own per run: nothing consumes the doorbells, and the relay rings
                    # no more once the broker holds OUTBOX_RELAY_MAX_QUEUED (a later mode on the same
                    # queue measured nothing).
                    linger = None if args.linger_ms is None else args.linger_ms / 1000
                    res = measure(
                        db.url, f"{prefix}{mode}-{rep}:", mode, samples, args.gap_ms / 1000, args.batch, linger
                    )
                    runs.append(res)
                    print(
                        f"[{rep + 1}/{repeats}] {mode:18} p50 {res['p50_ms']:7.2f} ms  p99 {res['p99_ms']:7.2f} ms  "
                        f"max {res['max_ms']:7.2f} ms  (n={res['samples']}, missing {res['missing']})",
                        flush=True,
                    )
    finally:
        keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            r.delete(*keys)
    summary = []
    print(f"\ncommit -> doorbell published, {samples} samples x {repeats} run(s): median [min-max] over runs")
    for mode in modes:
        rs = [x for x in runs if x["mode"] == mode]
        row = {"mode": mode}
        for k in ("p50_ms", "p99_ms", "max_ms"):
            v = [x[k] for x in rs]
            row[k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
        summary.append(row)
        print(
            f"{mode:18} "
            + "  ".join(
                f"{k[:-3]} {row[k]['median']:7.2f} [{row[k]['min']:.2f}-{row[k]['max']:.2f}]"
                for k in ("p50_ms", "p99_ms", "max_ms")
            )
        )
    out = {
        "benchmark": "relay-latency",
        "command": "python -m bench.relay_latency " + " ".join(argv or sys.argv[1:]),
        "samples": samples,
        "repeats": repeats,
        "gap_ms": args.gap_ms,
        "batch": args.batch,
        "linger_ms": args.linger_ms if args.linger_ms is not None else Settings().relay_linger_s * 1000,
        "environment": env,
        "summary": summary,
        "runs": runs,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"relay-latency-{dt.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
