"""Submit in the caller's transaction, per driver: intents/s and client CPU per intent, on one connection.

The application's transaction reaches the ledger on the application's driver
(outbox/ledger/drivers/postgres.py): a sync psycopg 3 session takes the raw path (the figure of
``bench/ledger_bench.py``), psycopg2 goes through SQLAlchemy ``text()``, and an ``AsyncSession``
(asyncpg, psycopg 3 async) runs the same submit under ``run_sync`` (``producer.submit_async``).
Each run submits ``--n`` intents after a warm-up, one per committed transaction (a commit's wait
for the disk dominates it), then ``--batch`` per transaction (the drivers' own cost shows); the
client's CPU per intent is measured beside the rate, which a shared machine moves less. The drivers
take turns in a rotated order per repeat; medians are reported.

    .venv/bin/python -m bench.submit_drivers [--quick] [--n 1000] [--repeats 3] [--drivers psycopg psycopg2 ...]

Prints a table and writes bench/results/submit-drivers-<date>[-quick].json. Needs the `asyncpg` and
`psycopg2` extras (the test extra has both), and PostgreSQL at OUTBOX_BENCH_PG_URL.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from bench.ledger_bench import _intent, machine
from bench.scratch_database import ScratchDatabase
from producer import submit, submit_async

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# name: (SQLAlchemy driver of the application's URL, AsyncSession)
DRIVERS: dict[str, tuple[str, bool]] = {
    "psycopg": ("postgresql+psycopg", False),
    "psycopg2": ("postgresql+psycopg2", False),
    "asyncpg": ("postgresql+asyncpg", True),
    "psycopg-async": ("postgresql+psycopg", True),
}


def run_sync_driver(url: str, n: int, batch: int, run: str, warmup: int) -> tuple[float, float]:
    engine = create_engine(url, pool_size=1, max_overflow=0)
    sessions = sessionmaker(engine, expire_on_commit=False)
    try:
        for i in range(warmup):  # connect and warm the statement caches outside the measured span
            with sessions.begin() as s:
                submit(s, **_intent(i, f"{run}-warm"))
        started, cpu = time.perf_counter(), time.process_time()
        for first in range(0, n, batch):
            with sessions.begin() as s:
                for i in range(first, min(first + batch, n)):
                    submit(s, **_intent(i, run))
        return n / (time.perf_counter() - started), (time.process_time() - cpu) / n
    finally:
        engine.dispose()


async def run_async_driver(url: str, n: int, batch: int, run: str, warmup: int) -> tuple[float, float]:
    engine = create_async_engine(url, pool_size=1, max_overflow=0)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    try:
        for i in range(warmup):
            async with sessions.begin() as s:
                await submit_async(s, **_intent(i, f"{run}-warm"))
        started, cpu = time.perf_counter(), time.process_time()
        for first in range(0, n, batch):
            async with sessions.begin() as s:
                for i in range(first, min(first + batch, n)):
                    await submit_async(s, **_intent(i, run))
        return n / (time.perf_counter() - started), (time.process_time() - cpu) / n
    finally:
        await engine.dispose()


def bench_driver(db_url: str, name: str, n: int, batch: int, run: str, warmup: int = 50) -> tuple[float, float]:
    """(intents/s, client CPU seconds per intent) for ``n`` intents, ``batch`` per transaction."""
    drivername, is_async = DRIVERS[name]
    url = make_url(db_url).set(drivername=drivername).render_as_string(hide_password=False)
    if is_async:
        return asyncio.run(run_async_driver(url, n, batch, run, warmup))
    return run_sync_driver(url, n, batch, run, warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 intents per run, one repeat (< 20 s)")
    parser.add_argument("--n", type=int, help="intents per run, one per transaction (default 1000)")
    parser.add_argument("--repeats", type=int, help="runs per driver (the median is reported; default 3)")
    parser.add_argument("--batch", type=int, default=100, help="intents per transaction of the batched runs")
    parser.add_argument("--drivers", nargs="+", choices=sorted(DRIVERS), default=list(DRIVERS))
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/submit-drivers-<date>.json)")
    args = parser.parse_args(argv)
    args.n = args.n or (300 if args.quick else 1000)
    args.repeats = args.repeats or (1 if args.quick else 3)

    when = dt.datetime.now(dt.UTC)
    load_before = os.getloadavg()
    shapes = {"one per transaction": 1, f"{args.batch} per transaction": args.batch}
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {s: {d: [] for d in args.drivers} for s in shapes}
    with ScratchDatabase() as db:
        print(f"database {db.name}; {args.n} intents per run, {args.repeats} repeats", flush=True)
        info = machine(db)
        for rep in range(args.repeats):
            # Rotated each repeat, so that drift (caches, WAL, a noisy neighbour) moves between drivers.
            order = args.drivers[rep % len(args.drivers) :] + args.drivers[: rep % len(args.drivers)]
            for shape, batch in shapes.items():
                for name in order:
                    runs[shape][name].append(bench_driver(db.url, name, args.n, batch, f"{name}-{batch}-r{rep}"))
                    rate, cpu = runs[shape][name][-1]
                    print(
                        f"  repeat {rep + 1} {shape:<20} {name:<14} {rate:7.0f} intents/s {cpu * 1e6:6.0f} us CPU",
                        flush=True,
                    )
    load_after = os.getloadavg()

    figures = {
        shape: {
            name: {
                "median_per_s": round(statistics.median(r for r, _ in v), 1),
                "median_cpu_us": round(statistics.median(c for _, c in v) * 1e6, 1),
                "runs_per_s": [round(r, 1) for r, _ in v],
            }
            for name, v in by_driver.items()
        }
        for shape, by_driver in runs.items()
    }
    print("\nsubmit in the caller's transaction (medians: intents/s, client CPU per intent)")
    for shape, by_driver in figures.items():
        for name, f in by_driver.items():
            print(f"  {shape:<20} {name:<14} {f['median_per_s']:7.0f}/s {f['median_cpu_us']:6.0f} us")
    print(f"load average before {load_before}, after {load_after}")

    out = args.out or RESULTS_DIR / f"submit-drivers-{when.date().isoformat()}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "date": when.isoformat(timespec="seconds"),
        "command": " ".join(
            [".venv/bin/python -m bench.submit_drivers", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": info | {"loadavg_before": load_before, "loadavg_after": load_after},
        "intents_per_run": args.n,
        "submit": figures,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
