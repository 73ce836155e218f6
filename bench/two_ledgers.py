"""One worker fleet draining two ledgers (OUTBOX_DATABASE_URLS), each in a PostgreSQL cluster of its own.

Every application keeps its outbox in its own database, so the way past one primary's CPU is one
fleet draining several ledgers. This measures what that costs each database, on this machine:

- two clusters initdb'd here with stock settings (tests/pg_cluster.py), a ledger database in each;
- the sandbox provider (plain path), the relay as its own process (``agent-outbox relay``: one
  relay thread per ledger) and W Celery worker processes (prefork), all with the same
  OUTBOX_DATABASE_URLS;
- per repeat and mode, two runs of N intents in all, each on fresh ledger databases: **one
  ledger** (N into ``a``; the fleet told of ``a`` alone) and **two ledgers** (N/2 into each; the
  fleet told of both). Modes: **backlog**, the intents written first (relay stopped, 100 per
  transaction), the clock from the relay's start until all N succeeded; **live**, written while
  the fleet runs by one agent thread per ledger, one intent per transaction (as agents submit),
  the clock from the first write. Checks: effects == N at the sandbox, no duplicate keys.

CPU per operation of each cluster is read from /proc: its postmaster, the postmaster's children
(backends, walwriter, checkpointer, autovacuum) and what its exited children spent; for the writes
(submit) and the drain separately, summed. With it, the scaling model: operations per second per
database core (1000 / that cluster's ms per operation) and per worker core.

    .venv/bin/python -m bench.two_ledgers [--quick] [--ops N] [--workers W] [--repeats R] [--mode both]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402
import yaml  # noqa: E402
from sqlalchemy import text  # noqa: E402

from bench.celery_workers import Workers  # noqa: E402
from bench.pipeline_bench import ARGS, REDIS_URL, actions_doc, wait_until  # noqa: E402
from outbox.ledger.models import OPERATIONS  # noqa: E402
from tests.loads.cpu_split import CpuSplit  # noqa: E402
from tests.pg_cluster import StockCluster  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_TICK = os.sysconf("SC_CLK_TCK")


def cluster_cpu_s(data_dir: Path) -> float:
    """CPU seconds of one cluster so far: its postmaster, the children it has (utime + stime) and
    those it has reaped (cutime + cstime)."""
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid, ppid = int(entry.name), int(fields[1])
        if pid == postmaster:
            total += sum(int(f) for f in fields[11:15]) / _TICK
        elif ppid == postmaster:
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


class Ledger:
    """A fresh ledger database in ``cluster`` (one per run: every run starts from empty tables)."""

    def __init__(self, name: str, cluster: StockCluster, admin_url: str) -> None:
        from outbox import migrate
        from outbox.ledger.db import make_engine, make_sessionmaker

        self.name, self.cluster, self.admin_url = name, cluster, admin_url
        self.database = f"outbox_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.database}"')
        self.url = admin_url.rsplit("/", 1)[0] + f"/{self.database}"
        self.engine = make_engine(self.url, pool_size=4)
        migrate.upgrade(self.engine)
        self.sessions = make_sessionmaker(self.engine)

    def drop(self) -> None:
        self.engine.dispose()
        with psycopg.connect(self.admin_url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE "{self.database}" WITH (FORCE)')

    def cpu_s(self) -> float:
        return cluster_cpu_s(self.cluster.data)

    def submit(self, tenant: str, n: int, batch: int = 100) -> None:
        from producer import submit

        for first in range(0, n, batch):
            with self.sessions.begin() as s:
                for i in range(first, min(first + batch, n)):
                    submit(
                        s,
                        tenant=tenant,
                        idempotency_key=f"{self.name}:{tenant}:{i}",
                        action="payments.refund.create",
                        args=ARGS,
                        subject="bench",
                    )

    def succeeded(self, tenant: str) -> int:
        with self.engine.connect() as c:
            return int(
                c.execute(
                    text(f"SELECT count(*) FROM {OPERATIONS} WHERE tenant = :t AND status = 'succeeded'"), {"t": tenant}
                ).scalar_one()
            )


def run(
    ledgers: list[Ledger], env: dict[str, str], tmp: Path, sandbox: Any, n: int, w: int, live: bool
) -> dict[str, Any]:
    """N intents spread evenly over ``ledgers``; the fleet told of these ledgers alone. ``live``:
    written while the fleet runs, one per transaction, one agent thread per ledger (the clock and
    the CPU counts from the first write); otherwise written first, 100 per transaction, the clock
    from the relay's start (a backlog drained)."""
    fleet_env = env | {"OUTBOX_DATABASE_URLS": ",".join(f"{lg.name}={lg.url}" for lg in ledgers)}
    share = n // len(ledgers)
    tenant = f"run-{uuid.uuid4().hex[:8]}"
    with Workers("workers", "prefork", w, fleet_env, tmp, queues="dispatch,outcome_unknown"):
        relay = _relay(fleet_env)
        try:
            # Warm-up: every worker process has connected to every ledger before the clock runs.
            for lg in ledgers:
                lg.submit(f"warm-{tenant}", 2 * w)
            for lg in ledgers:
                wait_until(lambda lg=lg: lg.succeeded(f"warm-{tenant}") == 2 * w, 60, 0.05, "warm-up")
            sandbox.reset()
            before = {lg.name: lg.cpu_s() for lg in ledgers}
            agents: list[threading.Thread] = []
            if live:
                split = CpuSplit().__enter__()
                started = time.perf_counter()
                agents = [threading.Thread(target=lg.submit, args=(tenant, share, 1)) for lg in ledgers]
                for agent in agents:
                    agent.start()
                written = before
            else:
                _stop(relay)
                for lg in ledgers:
                    lg.submit(tenant, share)
                written = {lg.name: lg.cpu_s() for lg in ledgers}
                split = CpuSplit().__enter__()
                started = time.perf_counter()
                relay = _relay(fleet_env)
            finished: dict[str, float] = {}
            while len(finished) < len(ledgers):
                for lg in ledgers:
                    if lg.name not in finished and lg.succeeded(tenant) >= share:
                        finished[lg.name] = time.perf_counter() - started
                if time.perf_counter() - started > 300:
                    raise RuntimeError(f"not all succeeded: {[lg.succeeded(tenant) for lg in ledgers]}")
                time.sleep(0.02)
            split.__exit__()
            drained = {lg.name: lg.cpu_s() for lg in ledgers}
            for agent in agents:
                agent.join()
        finally:
            _stop(relay)
    seconds = max(finished.values())
    total = share * len(ledgers)
    return {
        "ledgers": len(ledgers),
        "mode": "live" if live else "backlog",
        "ops": total,
        "workers": w,
        "seconds": round(seconds, 2),
        "ops_per_s": round(total / seconds, 1),
        "finished_s": {k: round(v, 2) for k, v in finished.items()},
        "effects": len(sandbox.effects()),
        "duplicates": len(sandbox.duplicates(by="key")),
        # Per cluster, ms per operation: the intents' writes (backlog: before the clock), the rest
        # (live: the writes included), and both.
        "db_cpu_ms_per_op": {
            lg.name: {
                "submit": round((written[lg.name] - before[lg.name]) * 1000 / share, 3),
                "drain": round((drained[lg.name] - written[lg.name]) * 1000 / share, 3),
                "all": round((drained[lg.name] - before[lg.name]) * 1000 / share, 3),
            }
            for lg in ledgers
        },
        "cpu_ms_per_op": {k: round(v * 1000 / total, 3) for k, v in split.seconds.items() if k != "postgres"},
    }


def _relay(env: dict[str, str]) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("agent-outbox")
    return subprocess.Popen(
        [str(exe), "relay"], env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,000 intents, one repeat (~1.5 min)")
    ap.add_argument("--ops", type=int, help="intents per run, in all (default 4,000; --quick 1,000)")
    ap.add_argument("--workers", type=int, default=2, help="prefork worker processes (default 2)")
    ap.add_argument("--repeats", type=int, help="default 2 (--quick 1)")
    ap.add_argument("--mode", choices=("backlog", "live", "both"), default="both", help="how intents arrive")
    args = ap.parse_args(argv)
    n = args.ops or (1000 if args.quick else 4000)
    repeats = args.repeats or (1 if args.quick else 2)
    modes = [live for live, name in ((False, "backlog"), (True, "live")) if args.mode in (name, "both")]
    from workers.sandbox.testing import SandboxProcess

    prefix = f"bench-ledgers-{uuid.uuid4().hex[:8]}:"
    runs: list[dict[str, Any]] = []
    r = redis.Redis.from_url(REDIS_URL)
    cluster_a, cluster_b = StockCluster(), StockCluster()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="two-ledgers-") as tmpdir,
            cluster_a as admin_a,
            cluster_b as admin_b,
            SandboxProcess() as sandbox,
        ):
            tmp = Path(tmpdir)
            sandbox.configure(request_log_max=1_000_000)
            actions = tmp / "actions.yaml"
            actions.write_text(yaml.safe_dump(actions_doc(sandbox.url), sort_keys=False))
            env = {
                "OUTBOX_BROKER_URL": REDIS_URL,
                "OUTBOX_REDIS_URL": REDIS_URL,
                "OUTBOX_BROKER_KEY_PREFIX": prefix,
                "OUTBOX_ACTIONS_FILE": str(actions),
                "OUTBOX_DATA_DIR": str(tmp / "data"),
            }
            for rep in range(repeats):
                for live in modes:
                    for count in (1, 2):
                        ledgers = [Ledger("a", cluster_a, admin_a), Ledger("b", cluster_b, admin_b)][:count]
                        try:
                            res = run(
                                ledgers,
                                env | {"OUTBOX_DATABASE_URL": ledgers[0].url},
                                tmp,
                                sandbox,
                                n,
                                args.workers,
                                live,
                            )
                        finally:
                            for lg in ledgers:
                                lg.drop()
                        runs.append(res)
                        print(
                            f"[{rep + 1}/{repeats}] {res['mode']:7} {res['ledgers']} ledger(s): {res['ops_per_s']:.0f} "
                            f"ops/s ({res['ops']} in {res['seconds']:.2f}s; finished {res['finished_s']}; effects "
                            f"{res['effects']}, dups {res['duplicates']}); database CPU ms/op "
                            f"{res['db_cpu_ms_per_op']}; other CPU ms/op {res['cpu_ms_per_op']}",
                            flush=True,
                        )
    finally:
        keys = [*r.scan_iter(match=f"{prefix}*", count=1000), *r.scan_iter(match=f"agent-outbox:*:{prefix}*")]
        if keys:
            r.delete(*keys)
    summary = summarise(runs)
    for row in summary:
        print(
            f"{row['mode']:7} {row['ledgers']} ledger(s): median {row['ops_per_s']:.0f} ops/s; per database: "
            f"{row['db_ms_per_op']} ms CPU/op -> {row['ops_per_s_per_db_core']} ops/s per database core; "
            f"workers {row['workers_ms_per_op']} ms CPU/op -> {row['ops_per_s_per_worker_core']} ops/s per worker core; "
            f"relay {row['relay_ms_per_op']} ms CPU/op"
        )
    ok = all(run["effects"] == run["ops"] and run["duplicates"] == 0 for run in runs)
    out = {
        "benchmark": "two_ledgers",
        "command": "python -m bench.two_ledgers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "ops": n,
        "repeats": repeats,
        "summary": summary,
        "runs": runs,
        "effects_exact": ok,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"two-ledgers-{dt.datetime.now(dt.UTC):%Y-%m-%d-%H%M}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"written: {path.relative_to(ROOT)}; every effect exactly once: {ok}")
    return 0 if ok else 1


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode, count in sorted({(run["mode"], run["ledgers"]) for run in runs}):
        mine = [run for run in runs if run["ledgers"] == count and run["mode"] == mode]
        names = sorted(mine[0]["db_cpu_ms_per_op"])
        db = {name: round(statistics.median(run["db_cpu_ms_per_op"][name]["all"] for run in mine), 3) for name in names}
        workers = round(statistics.median(run["cpu_ms_per_op"].get("celery workers", 0.0) for run in mine), 3)
        relay = round(statistics.median(run["cpu_ms_per_op"].get("relay", 0.0) for run in mine), 3)
        rows.append(
            {
                "mode": mode,
                "ledgers": count,
                "ops_per_s": statistics.median(run["ops_per_s"] for run in mine),
                "db_ms_per_op": db,
                "ops_per_s_per_db_core": {name: round(1000 / ms) if ms else None for name, ms in db.items()},
                "workers_ms_per_op": workers,
                "ops_per_s_per_worker_core": round(1000 / workers) if workers else None,
                "relay_ms_per_op": relay,
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
