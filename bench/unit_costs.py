"""The unit costs the end-to-end model is made of, each measured alone on this machine.

- PostgreSQL's CPU per single-row insert transaction (BEGIN, INSERT, COMMIT: what an agent's
  one-intent transaction costs the database beyond the outbox's own statement), with a NOTIFY to a
  listening backend, and with ``synchronous_commit = off`` (what the WAL flush costs);
- the HTTP client's CPU per request to the sandbox, httpx and httpx2;
- Celery's ``send_task`` per doorbell of 8 ids (the relay's publish), as Celery spells the
  arguments (``saferepr``) and with ``argsrepr`` given.

    .venv/bin/python -m bench.unit_costs [--n 5000] [--rounds 3]

Needs the machine's PostgreSQL and Redis (OUTBOX_BENCH_PG_URL; OUTBOX_UNIT_COSTS_REDIS_URL, Redis
database 14 unless set); a throwaway database and queues of a name of their own are used and
removed. Results: bench/results/unit-costs-<date>.json.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.scratch_database import ADMIN_URL, libpq  # noqa: E402
from tests.loads.cpu_split import CpuSplit  # noqa: E402

# Its own variable: the other benches' OUTBOX_BENCH_REDIS_URL may name a database in use.
REDIS_URL = os.environ.get("OUTBOX_UNIT_COSTS_REDIS_URL", "redis://127.0.0.1:6379/14")
INSERT = "WITH ins AS (INSERT INTO t (id, body) VALUES (%s, %s) RETURNING id) SELECT {tail} FROM ins"


def _transactions(url: str, n: int, *, notify: bool, synchronous: bool) -> float:
    """PostgreSQL's CPU (ms) per one-row insert transaction."""
    statement = INSERT.format(tail="pg_notify('unit_costs', id)" if notify else "id")
    with psycopg.connect(url) as conn:
        if not synchronous:
            conn.execute("SET synchronous_commit = off")
            conn.commit()
        with CpuSplit() as split:
            for _ in range(n):
                conn.execute(statement, (uuid.uuid4().hex, "x" * 300))
                conn.commit()
    return split.seconds.get("postgres", 0.0) * 1000 / n


def database_costs(n: int, rounds: int) -> dict[str, list[float]]:
    db = f"outbox_bench_{uuid.uuid4().hex[:10]}"
    admin = libpq(ADMIN_URL)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    url = libpq(ADMIN_URL.rsplit("/", 1)[0] + "/" + db)
    stop = threading.Event()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id text PRIMARY KEY, body text, at timestamptz DEFAULT now())")

        def listen() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("LISTEN unit_costs")
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.2):
                        pass

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        time.sleep(0.5)
        out: dict[str, list[float]] = {"insert transaction": [], "with NOTIFY": [], "synchronous_commit off": []}
        for _ in range(rounds):
            out["insert transaction"].append(_transactions(url, n, notify=False, synchronous=True))
            out["with NOTIFY"].append(_transactions(url, n, notify=True, synchronous=True))
            out["synchronous_commit off"].append(_transactions(url, n, notify=False, synchronous=False))
        stop.set()
        listener.join()
        return out
    finally:
        stop.set()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    started = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - started) * 1e6 / n


def _get(client: Any) -> None:
    client.get("/health").read()


def http_costs(n: int, rounds: int) -> dict[str, list[float]]:
    import httpx
    import httpx2

    from workers.sandbox.testing import SandboxProcess

    out: dict[str, list[float]] = {"httpx": [], "httpx2": []}
    with SandboxProcess() as sandbox:
        for _ in range(rounds):
            for name, module in (("httpx", httpx), ("httpx2", httpx2)):
                with module.Client(base_url=sandbox.url.rstrip("/"), timeout=5) as client:
                    client.get("/health")
                    out[name].append(_per_call_us(lambda: _get(client), n))
    return out


def publish_costs(n: int, rounds: int) -> dict[str, list[float]]:
    import redis

    os.environ["OUTBOX_BROKER_URL"] = REDIS_URL
    from workers.engine.doorbell import Doorbell
    from workers.wiring.celery_app import make_app

    app = make_app()
    ledger = f"unit{uuid.uuid4().hex[:6]}"  # its queue names carry it: only those keys are deleted
    doorbell = Doorbell(app, batch=8, ledger=ledger)
    ids = [str(uuid.uuid4()) for _ in range(8)]
    send = app.send_task

    def saferepr(name: str, *, argsrepr: Any = None, kwargsrepr: Any = None, **options: Any) -> Any:
        return send(name, **options)  # Celery spells the arguments itself (saferepr)

    # The doorbell gives argsrepr (workers/engine/doorbell.py); "send_task" is Celery's own spelling.
    out: dict[str, list[float]] = {"send_task": [], "send_task, argsrepr given": []}
    try:
        for _ in range(rounds):
            for name, fn in (("send_task", saferepr), ("send_task, argsrepr given", send)):
                app.send_task = fn
                out[name].append(_per_call_us(lambda: doorbell.ring_dispatch(ids), n))
    finally:
        app.send_task = send
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"*{ledger}*"):
            client.delete(key)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000, help="calls per measurement (transactions, requests, doorbells)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {}
    for title, unit, measure in (
        ("PostgreSQL CPU per one-row insert transaction", "ms", database_costs),
        ("client CPU per HTTP request to the sandbox", "us", http_costs),
        ("relay CPU per doorbell of 8 ids", "us", publish_costs),
    ):
        print(f"{title} ({unit}), {a.rounds} rounds of {a.n}:", flush=True)
        got = measure(a.n, a.rounds)
        for name, values in got.items():
            shown = ", ".join(f"{v:.3f}" if unit == "ms" else f"{v:.0f}" for v in values)
            print(f"  {name:<28} median {statistics.median(values):.3f}  [{shown}]", flush=True)
        results[title] = got
    path = ROOT / "bench" / "results" / f"unit-costs-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps({"n": a.n, "rounds": a.rounds, "results": results}, indent=2) + "\n")
    print(f"written: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
