"""End-to-end pipeline throughput (submit -> succeeded) beside bare Celery, same broker, same run.

For each repeat, pool (prefork: one worker with ``-c W``; solo: W worker processes) and worker
count W, in this order so that both sides see the same machine noise:

1. **outbox**: the sandbox provider (``python -m workers.sandbox``, plain path, no faults) as a subprocess,
   a throwaway PostgreSQL database (created, migrated, dropped), the relay as its own process
   (``agent-outbox relay``, LISTEN/NOTIFY, as deployed; the clock starts only once it holds the
   NOTIFY leader lock), and W real Celery worker processes (``celery -A workers worker``). After a warm-up (2*W operations,
   then the sandbox is reset), N intents are **submitted while everything runs**, one intent per
   transaction from this process (``--submit-batch`` to change), and the clock runs from the first
   submit to the moment all N are ``succeeded`` (polled every 10 ms). Checks: sandbox effects == N,
   no duplicate keys.
2. **bare Celery** (``bench/bare_celery.py``): same Redis, its own key prefix, JSON, acks_late,
   prefetch 1, results ignored, same pool and worker count; a no-op task that INCRs a counter;
   N tasks published from this process, clock from the first publish to counter == N.

Reports ops/s (median and range over repeats), the ratio outbox/bare, and the RSS of each worker
process after the run. Writes bench/results/pipeline-<date>[-<options>][-<tag>].json.

    .venv/bin/python -m bench.pipeline_bench [--quick] [--ops N] [--workers 2,4] [--pools prefork,solo]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml
from sqlalchemy import text

from bench.celery_workers import Workers
from bench.scratch_database import ScratchDatabase
from outbox.ledger.models import OPERATIONS
from outbox.ledger.states import DISPATCH_CLAIMABLE, RECONCILE_CLAIMABLE, Status
from tests.loads.cpu_split import CpuSplit

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
ARGS = {"order_id": "ord-bench", "amount": "12.50", "currency": "EUR", "reason": "bench"}


def actions_doc(base_url: str) -> dict[str, Any]:
    """The shape of tests/harness.py ``actions_doc``: one refund action on the sandbox."""
    return {
        "targets": {
            "sandbox": {
                "base_url": base_url,
                "timeout_s": 2.0,
                "connect_timeout_s": 0.5,
                "breaker": {"fail_max": 1000, "reset_timeout_s": 5},
            }
        },
        "actions": {
            "payments.refund.create": {
                "target": "sandbox",
                "request": {"method": "POST", "path": "/v1/refunds"},
                "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
                "fencing_header": "X-Fencing-Token",
                "lookup": {
                    "request": {
                        "method": "GET",
                        "path": "/v1/refunds",
                        "query": {"idempotency_key": "{idempotency_key}"},
                    },
                    "authoritative_not_found": True,
                    "settle_s": 0.5,
                    "succeeded": ["succeeded"],
                    "pending": ["pending"],
                    "failed": ["failed"],
                },
                "result_reference": "id",
                "decimal_args": ["amount"],
                "budget": {"max_attempts": 4, "deadline_s": 120, "base_delay_s": 0.1, "max_delay_s": 1},
            }
        },
    }


def wait_until(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.01, what: str = "") -> float:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval_s)
    return time.perf_counter()


def machine_per_op(split: CpuSplit, n: int) -> dict[str, Any]:
    """The whole machine's per operation (tests/loads/cpu_split.py): context switches, and the ms of
    steal, busy and idle CPU. A slow run with steal was a taken machine; with more switches per
    operation, a run that handed work between processes more often."""
    m = split.machine
    return {
        "context_switches": round(m.get("context_switches", 0.0) / n, 1),
        "steal_ms": round(m.get("steal_s", 0.0) * 1000 / n, 3),
        "busy_ms": round(m.get("busy_s", 0.0) * 1000 / n, 3),
        "idle_ms": round(m.get("idle_s", 0.0) * 1000 / n, 3),
        "switches_by_kind": {k: round(v / n, 1) for k, v in split.switches.items()},
    }


# ---- the outbox pipeline ------------------------------------------------------------------------


class Outbox:
    """Sandbox + database + relay process for the whole run; workers per measurement."""

    def __init__(
        self, db_url: str, sandbox_url: str, tmp: Path, prefix: str, target: dict[str, Any] | None = None
    ) -> None:
        """``target``: settings added to the sandbox target's (a rate limit, say)."""
        from outbox.ledger.db import make_engine, make_sessionmaker

        doc = actions_doc(sandbox_url)
        doc["targets"]["sandbox"].update(target or {})
        actions = tmp / "actions.yaml"
        actions.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.env = {
            "OUTBOX_DATABASE_URL": db_url,
            "OUTBOX_BROKER_URL": REDIS_URL,
            "OUTBOX_REDIS_URL": REDIS_URL,
            "OUTBOX_BROKER_KEY_PREFIX": prefix,
            "OUTBOX_ACTIONS_FILE": str(actions),
            "OUTBOX_DATA_DIR": str(tmp / "data"),
        }
        self.engine = make_engine(db_url, pool_size=8)
        self.sessions = make_sessionmaker(self.engine)
        self.tmp = tmp
        self.relay: subprocess.Popen[bytes] | None = None

    def start_relay(self, timeout_s: float = 30.0) -> None:
        """``agent-outbox relay`` as its own process (as deployed: no GIL shared with the agents)."""
        from outbox.ledger.drivers.pg_statements import NOTIFY_LEADER_LOCK

        exe = Path(sys.executable).with_name("agent-outbox")
        self.relay = subprocess.Popen(
            [str(exe), "relay"], env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        # Only the leader rings doorbells from NOTIFY; before it leads, ids wait for a tick.
        leading = text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND ((classid::bigint << 32) | objid::bigint) = :key"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            with self.engine.connect() as c:
                if c.execute(leading, {"key": NOTIFY_LEADER_LOCK}).scalar_one():
                    return
            if self.relay.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the relay did not start leading (exit code {self.relay.poll()})")
            time.sleep(0.05)

    def stop_relay(self) -> None:
        if self.relay is not None:
            self.relay.terminate()
            try:
                self.relay.wait(10)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait(10)
            self.relay = None

    def submit_all(self, tenant: str, n: int, batch: int, submitters: int = 1) -> None:
        """N intents, ``batch`` per transaction, from ``submitters`` concurrent threads (agents)."""
        batch = max(1, batch)

        def agent(k: int) -> None:
            for first in range(k * batch, n, batch * submitters):
                with self.sessions.begin() as s:
                    self.submit_range(s, tenant, first, min(first + batch, n))

        if submitters == 1:
            agent(0)
            return
        threads = [threading.Thread(target=agent, args=(k,)) for k in range(submitters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @staticmethod
    def submit_range(session: Any, tenant: str, first: int, end: int) -> None:
        from producer import submit

        for i in range(first, end):
            submit(
                session,
                tenant=tenant,
                idempotency_key=f"{tenant}:refund-{i}",
                action="payments.refund.create",
                args=ARGS,
                subject="bench",
            )

    def submit_backlog(self, tenant: str, n: int, on_commit: Callable[[], None]) -> None:
        """N intents in one transaction, ``on_commit`` called just before it commits: to a running
        relay they are all due at once, a backlog."""
        with self.sessions.begin() as s:
            self.submit_range(s, tenant, 0, n)
            on_commit()

    def count(self, tenant: str, status: str = "succeeded") -> int:
        with self.engine.connect() as c:
            return int(
                c.execute(
                    text(f"SELECT count(*) FROM {OPERATIONS} WHERE tenant = :t AND status = :s"),
                    {"t": tenant, "s": status},
                ).scalar_one()
            )

    def unfinished(self, tenant: str) -> bool:
        """Whether any of the tenant's operations is still on its way, asked through the partial
        indexes of those states (each EXISTS stops at its first row): the wait polls this every 10 ms,
        and a count(*) of the tenant's succeeded rows cost the database ~1.5 ms a poll at 5,000 rows,
        ~0.15 ms per operation charged to the outbox's side of the comparison (bench/README.md)."""
        exists = " OR ".join(
            f"EXISTS (SELECT 1 FROM {OPERATIONS} WHERE status = '{status}' AND tenant = :t)"
            for status in sorted(s.value for s in (*DISPATCH_CLAIMABLE, Status.DISPATCHING, *RECONCILE_CLAIMABLE))
        )
        with self.engine.connect() as c:
            # Statistics taken while every row was due make a scan look cheaper than the index,
            # and the scan reads the whole table once nothing is left.
            c.execute(text("SET LOCAL enable_seqscan = off"))
            return bool(c.execute(text(f"SELECT {exists}"), {"t": tenant}).scalar_one())

    def statuses(self, tenant: str) -> dict[str, int]:
        with self.engine.connect() as c:
            rows = c.execute(
                text(f"SELECT status, count(*) FROM {OPERATIONS} WHERE tenant = :t GROUP BY status"), {"t": tenant}
            ).all()
        return {r[0]: int(r[1]) for r in rows}


def run_outbox(
    ob: Outbox,
    sandbox: Any,
    pool: str,
    w: int,
    n: int,
    batch: int,
    timeout_s: float,
    presubmit: bool = False,
    submitters: int = 1,
    slow: float = 0.0,
    nodes: int = 1,
    task_events: bool = False,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    env = ob.env | {"OUTBOX_TASK_EVENTS": "true" if task_events else "false"}
    sink = EventSink(env, ob.tmp).start() if task_events else None
    try:
        result = _run_outbox(ob, sandbox, pool, w, n, batch, timeout_s, presubmit, submitters, slow, nodes, env, tag)
    finally:
        events = sink.stop() if sink is not None else {}
    result["task_events"] = task_events
    if task_events:
        result["side"] = "outbox_events"
        # Events the consumer took in per operation (the warm-up's included): 3 for a clean call.
        result["events_per_op"] = round(sum(events.values()) / (n + 2 * w * nodes), 2)
        result["events"] = events
    return result


class EventSink:
    """bench/event_sink.py as a process: every event delivered to a consumer, as where Flower runs."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        tag = uuid.uuid4().hex[:6]
        self.env, self.ready, self.counts = env, tmp / f"sink-{tag}.ready", tmp / f"sink-{tag}.json"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EventSink:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.event_sink", str(self.ready), str(self.counts)],
            env={**os.environ, **self.env},
            cwd=ROOT,
        )
        wait_until(lambda: self.ready.exists() or self.proc.poll() is not None, 60, 0.05, "the event consumer")  # type: ignore[union-attr]
        return self

    def stop(self) -> dict[str, int]:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(30)
        return dict(json.loads(self.counts.read_text())) if self.counts.exists() else {}


def _run_outbox(
    ob: Outbox,
    sandbox: Any,
    pool: str,
    w: int,
    n: int,
    batch: int,
    timeout_s: float,
    presubmit: bool,
    submitters: int,
    slow: float,
    nodes: int,
    env: dict[str, str],
    tag: str,
) -> dict[str, Any]:
    with Workers("workers", pool, w, env, ob.tmp, queues="dispatch,outcome_unknown", nodes=nodes) as workers:
        warm = f"warm-{tag}"
        ob.submit_all(warm, 2 * w, 1)
        wait_until(lambda: ob.count(warm) == 2 * w, 60, 0.02, "warm-up")
        sandbox.reset()
        if slow:
            # A share of calls answers after 800 ms (inside the 1 s read timeout): head-of-line blocking.
            sandbox.add_fault(mode="latency", method="POST", probability=slow, latency_ms=800, seed=11)
        tenant = f"run-{tag}"
        split = CpuSplit()
        if presubmit:  # a backlog: N intents committed at once to the running relay; the clock starts at the commit
            marks: list[float] = []

            def clock_starts() -> None:
                split.__enter__()
                marks.append(time.perf_counter())

            ob.submit_backlog(tenant, n, clock_starts)
            started = marks[0]
        else:
            split.__enter__()
            started = time.perf_counter()
            ob.submit_all(tenant, n, batch, submitters)
        submitted = time.perf_counter()
        try:
            ended = wait_until(lambda: not ob.unfinished(tenant), timeout_s, 0.01, "all finished")
        except TimeoutError:
            raise RuntimeError(f"not all succeeded: {ob.statuses(tenant)}") from None
        if ob.count(tenant) < n:
            raise RuntimeError(f"not all succeeded: {ob.statuses(tenant)}")
        split.__exit__()
        rss = workers.rss_kib()
    effects = sandbox.effects()
    dups = sandbox.duplicates(by="key")
    seconds = ended - started
    return {
        "side": "outbox",
        "pool": pool,
        "workers": w,
        "nodes": nodes,
        "ops": n,
        "seconds": seconds,
        "ops_per_s": n / seconds,
        "submit_s": submitted - started,
        "submit_batch": batch,
        "submitters": submitters,
        "presubmit": presubmit,
        "effects": len(effects),
        "duplicates": len(dups),
        "rss_kib": rss,
        "cpu_ms_per_op": {k: round(v * 1000 / n, 2) for k, v in split.seconds.items()},
        "postgres_cpu_ms_per_op_by_role": {k: round(v * 1000 / n, 3) for k, v in split.postgres.items()},
        "machine_per_op": machine_per_op(split, n),
    }


# ---- bare Celery ---------------------------------------------------------------------------------


def run_bare(env: dict[str, str], tmp: Path, pool: str, w: int, n: int, timeout_s: float) -> dict[str, Any]:
    from bench import bare_celery

    r = redis.Redis.from_url(REDIS_URL)
    key = bare_celery.counter_key()
    app = bare_celery.app
    with Workers("bench.bare_celery", pool, w, env, tmp, queues=bare_celery.QUEUE) as workers:

        def publish(k: int) -> None:
            with app.producer_or_acquire() as producer:
                for i in range(k):
                    app.send_task("bench.noop", args=[i], queue=bare_celery.QUEUE, producer=producer)

        r.set(key, 0)
        publish(2 * w)
        wait_until(lambda: int(r.get(key) or 0) >= 2 * w, 60, 0.02, "bare warm-up")
        r.set(key, 0)
        with CpuSplit() as split:
            started = time.perf_counter()
            publish(n)
            published = time.perf_counter()
            ended = wait_until(lambda: int(r.get(key) or 0) >= n, timeout_s, 0.01, "bare executed")
        rss = workers.rss_kib()
    seconds = ended - started
    return {
        "side": "bare",
        "pool": pool,
        "workers": w,
        "ops": n,
        "seconds": seconds,
        "ops_per_s": n / seconds,
        "publish_s": published - started,
        "executed": int(r.get(key) or 0),
        "rss_kib": rss,
        "cpu_ms_per_op": {k: round(v * 1000 / n, 2) for k, v in split.seconds.items()},
        "machine_per_op": machine_per_op(split, n),
    }


# ---- the naive pipeline (what a team would write instead) ---------------------------------------


def run_naive(env: dict[str, str], dsn: str, tmp: Path, pool: str, w: int, n: int, timeout_s: float) -> dict[str, Any]:
    from bench import naive_pipeline as naive

    naive.prepare(dsn)
    with Workers("bench.naive_pipeline", pool, w, env, tmp, queues=naive.QUEUE) as workers:
        naive.submit(dsn, 2 * w, tag="warm")
        wait_until(lambda: naive.settled(dsn) >= 2 * w, 60, 0.02, "naive warm-up")
        naive.prepare(dsn)
        with CpuSplit() as split:
            started = time.perf_counter()
            naive.submit(dsn, n, tag=f"n{pool}{w}-{uuid.uuid4().hex[:6]}")
            submitted = time.perf_counter()
            ended = wait_until(lambda: naive.settled(dsn) >= n, timeout_s, 0.02, "naive settled")
        rss = workers.rss_kib()
    seconds = ended - started
    return {
        "side": "naive",
        "pool": pool,
        "workers": w,
        "ops": n,
        "seconds": seconds,
        "ops_per_s": n / seconds,
        "submit_s": submitted - started,
        "rss_kib": rss,
        "cpu_ms_per_op": {k: round(v * 1000 / n, 2) for k, v in split.seconds.items()},
        "machine_per_op": machine_per_op(split, n),
    }


# ---- report --------------------------------------------------------------------------------------


def environment(db: ScratchDatabase) -> dict[str, Any]:
    from bench.ledger_bench import machine

    info = machine(db)
    info["redis"] = redis.Redis.from_url(REDIS_URL).info("server").get("redis_version")
    info["date"] = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    import celery

    info["celery"] = celery.__version__
    return info


def _measured(runs: list[dict[str, Any]], side: str, pool: str, w: int, nodes: int = 1) -> list[dict[str, Any]]:
    """The runs of one side and configuration (bare Celery and the naive pipeline run on 1 node)."""
    return [r for r in runs if (r["side"], r["pool"], r["workers"], r.get("nodes", 1)) == (side, pool, w, nodes)]


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for pool, w in sorted({(r["pool"], r["workers"]) for r in runs}):
        row: dict[str, Any] = {"pool": pool, "workers": w}
        for side in ("outbox", "outbox_events", "bare", "naive"):
            rates = [r["ops_per_s"] for r in _measured(runs, side, pool, w)]
            if rates:
                row[side] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "runs": rates}
        if "outbox" not in row:  # --task-events on alone: the events-on runs are the outbox's
            row["outbox"] = row.pop("outbox_events")
        if "outbox_events" in row:
            # Events on beside off, each repeat's pair (run back to back) and the medians.
            pairs = _event_pairs(runs, pool, w)
            cpu = _event_pairs(runs, pool, w, key="celery workers")
            row["events_cost"] = {
                "median": 1 - row["outbox_events"]["median"] / row["outbox"]["median"],
                "pairs": [round(1 - on / off, 4) for off, on in pairs],
                # The workers' CPU per operation, on beside off in each pair: less sensitive than
                # throughput to what else the machine runs.
                "workers_cpu_pairs": [round(on / off - 1, 4) for off, on in cpu],
                "workers_cpu_median": statistics.median(on / off - 1 for off, on in cpu) if cpu else None,
            }
        row["ratio"] = row["outbox"]["median"] / row["bare"]["median"]
        if "naive" in row:
            row["ratio_naive"] = row["outbox"]["median"] / row["naive"]["median"]
        for side, prefix in (("outbox", ""), ("bare", "bare_"), ("naive", "naive_")):
            # RSS counts the pages a task process shares with its parent; USS only its own.
            for kind, key in (("rss", "executing"), ("uss", "executing_uss"), ("pss", "executing_pss")):
                values = [
                    statistics.median(r["rss_kib"][key]) / 1024
                    for r in _measured(runs, side, pool, w)
                    if r["rss_kib"].get(key)
                ]
                row[f"{kind}_mib_{prefix}executing"] = statistics.median(values) if values else None
        row["effects_ok"] = all(
            r["effects"] == r["ops"] and r["duplicates"] == 0
            for r in _measured(runs, "outbox", pool, w) + _measured(runs, "outbox_events", pool, w)
        )
        rows.append(row)
    return rows


def _event_pairs(runs: list[dict[str, Any]], pool: str, w: int, key: str = "") -> list[tuple[float, float]]:
    """(events off, events on) of each repeat, in run order (the two ran back to back): ops/s, or
    the CPU ms per operation of ``key``'s processes."""

    def of(r: dict[str, Any]) -> float:
        return float(r["cpu_ms_per_op"].get(key, 0.0)) if key else float(r["ops_per_s"])

    off = [of(r) for r in _measured(runs, "outbox", pool, w)]
    on = [of(r) for r in _measured(runs, "outbox_events", pool, w)]
    return list(zip(off, on))


def scale_out(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outbox's rate by worker nodes (same pool and processes per node): how throughput grows
    with workers, and what PostgreSQL spends per operation meanwhile."""
    rows = []
    for pool, w, nodes in sorted({(r["pool"], r["workers"], r.get("nodes", 1)) for r in runs if r["side"] == "outbox"}):
        mine = _measured(runs, "outbox", pool, w, nodes)
        rows.append(
            {
                "pool": pool,
                "workers": w,
                "nodes": nodes,
                "ops_per_s": statistics.median(r["ops_per_s"] for r in mine),
                "postgres_cpu_ms_per_op": statistics.median(r["cpu_ms_per_op"].get("postgres", 0.0) for r in mine),
                "workers_cpu_ms_per_op": statistics.median(r["cpu_ms_per_op"].get("celery workers", 0.0) for r in mine),
                "cpu_ms_per_op": statistics.median(sum(r["cpu_ms_per_op"].values()) for r in mine),
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], n: int, repeats: int) -> None:
    print(f"\nsubmit -> succeeded, N={n}, {repeats} run(s) each: median ops/s [min-max]")
    print(
        f"{'pool':8} {'W':>2} {'outbox ops/s':>24} {'bare Celery ops/s':>24} {'ratio':>6} "
        f"{'RSS/proc MiB':>13} {'USS/proc MiB':>13} {'effects==N':>10}   naive pipeline ops/s (outbox/naive)"
    )
    for r in rows:
        o, b = r["outbox"], r["bare"]
        naive = r.get("naive")
        print(
            f"{r['pool']:8} {r['workers']:>2} {o['median']:>8.0f} [{o['min']:.0f}-{o['max']:.0f}]".ljust(36)
            + f"{b['median']:>8.0f} [{b['min']:.0f}-{b['max']:.0f}]".ljust(25)
            + f"{r['ratio']:>6.2f} {r['rss_mib_executing']:>6.1f} ({r['rss_mib_bare_executing']:.1f})"
            + f" {r['uss_mib_executing'] or 0:>6.1f} ({r['uss_mib_bare_executing'] or 0:.1f})"
            + f" {str(r['effects_ok']):>10}"
            + (
                f"   {naive['median']:.0f} [{naive['min']:.0f}-{naive['max']:.0f}] ({r['ratio_naive']:.2f})"
                if naive
                else ""
            )
        )


def print_events(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "events_cost" not in r:
            continue
        off, on, cost = r["outbox"], r["outbox_events"], r["events_cost"]
        print(
            f"task events {r['pool']} W={r['workers']}: off {off['median']:.0f} [{off['min']:.0f}-{off['max']:.0f}], "
            f"on {on['median']:.0f} [{on['min']:.0f}-{on['max']:.0f}] ops/s: on costs {cost['median']:+.1%} "
            f"(per repeat, back to back: {', '.join(f'{p:+.1%}' for p in cost['pairs'])}); the workers' CPU per "
            f"operation {cost['workers_cpu_median']:+.1%} (per repeat: "
            f"{', '.join(f'{p:+.1%}' for p in cost['workers_cpu_pairs'])})"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N=300, one run, workers 2, prefork only")
    p.add_argument("--ops", type=int, default=None, help="operations per measurement (default 1000)")
    p.add_argument("--workers", default=None, help="comma-separated worker counts (default 2,4)")
    p.add_argument("--pools", default=None, help="prefork,solo (default both)")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration (default 3)")
    p.add_argument("--submit-batch", type=int, default=1, help="intents per submit transaction")
    p.add_argument(
        "--submitters",
        type=int,
        default=1,
        help="concurrent submitting threads (agents), each one intent per transaction",
    )
    p.add_argument(
        "--presubmit",
        action="store_true",
        help="write the N intents in one transaction, the clock starting at its commit (a backlog, all due at "
        "once, to the relay and workers already running): measures relay + workers without the submitter",
    )
    p.add_argument("--bare-events", action="store_true", help="bare Celery also sends task events")
    p.add_argument(
        "--nodes",
        default="1",
        help="comma-separated worker node counts for the outbox (scale-out: each node a `celery worker` with "
        "--workers processes; the ratios use 1 node)",
    )
    p.add_argument(
        "--slow",
        type=float,
        default=0.0,
        help="share of the outbox's provider calls answering after 800 ms (head-of-line blocking; "
        "bare Celery stays clean, so read the outbox figure, not the ratio)",
    )
    p.add_argument(
        "--no-naive",
        action="store_true",
        help="leave out the naive pipeline (bench/naive_pipeline.py: task per intent, tenacity, pybreaker)",
    )
    p.add_argument(
        "--cpu-quota",
        type=float,
        default=0.0,
        help="run under a cgroup CPU quota of this many CPUs (bench/cpu_quota.py: a slower CPU emulated; "
        "the machine's PostgreSQL and Redis stay outside it)",
    )
    p.add_argument(
        "--task-events",
        choices=("off", "on", "both"),
        default="off",
        help="the outbox's workers send task events (OUTBOX_TASK_EVENTS; each call a task in Flower), with a "
        "consumer taking them in as Flower would (bench/event_sink.py); both: off and on back to back in each "
        "repeat (the order alternating), and the cost of on",
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument(
        "--tag",
        default="",
        help="added to the results file's name (bench.pg_statements passes one, so its run does not replace "
        "this day's pipeline figures)",
    )
    args = p.parse_args(argv)
    if args.cpu_quota:
        from bench.cpu_quota import CpuQuota

        with CpuQuota(args.cpu_quota):
            return _main(args, argv)
    return _main(args, argv)


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    n = args.ops or (300 if args.quick else 1000)
    counts = [int(x) for x in (args.workers or ("2" if args.quick else "2,4")).split(",")]
    node_counts = [int(x) for x in args.nodes.split(",")]
    pools = (args.pools or ("prefork" if args.quick else "prefork,solo")).split(",")
    repeats = args.repeats or (1 if args.quick else 3)

    from workers.sandbox.testing import SandboxProcess

    root = f"bench-pipe-{uuid.uuid4().hex[:8]}:"
    bare_env = {
        "BENCH_BARE_BROKER_URL": REDIS_URL,
        "BENCH_BARE_PREFIX": root + "bare:",
        "BENCH_BARE_EVENTS": "1" if args.bare_events else "0",
    }
    os.environ.update(bare_env)  # bench.bare_celery reads them at import, here and in its workers
    naive_env = {"BENCH_NAIVE_BROKER_URL": REDIS_URL, "BENCH_NAIVE_PREFIX": root + "naive:"}
    runs: list[dict[str, Any]] = []
    r = redis.Redis.from_url(REDIS_URL)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="pipeline-bench-") as tmpdir,
            ScratchDatabase() as db,
            SandboxProcess() as sandbox,
        ):
            tmp = Path(tmpdir)
            sandbox.configure(request_log_max=1_000_000)
            dsn = db.url.replace("postgresql+psycopg://", "postgresql://")
            naive_env |= {"BENCH_NAIVE_DB": dsn, "BENCH_NAIVE_SANDBOX": sandbox.url}
            from bench.naive_pipeline import configure

            configure(naive_env["BENCH_NAIVE_PREFIX"])
            env = environment(db)
            ob = Outbox(db.url, sandbox.url, tmp, root + "ours:")
            ob.start_relay()
            try:
                for rep in range(repeats):
                    for pool in pools:
                        for w in counts:
                            modes = {"off": [False], "on": [True], "both": [False, True]}[args.task_events]
                            for nodes, events in [(k, e) for k in node_counts for e in modes[:: 1 - 2 * (rep % 2)]]:
                                res = run_outbox(
                                    ob,
                                    sandbox,
                                    pool,
                                    w,
                                    n,
                                    args.submit_batch,
                                    args.timeout,
                                    args.presubmit,
                                    args.submitters,
                                    args.slow,
                                    nodes,
                                    events,
                                )
                                runs.append(res)
                                print(
                                    f"[{rep + 1}/{repeats}] outbox {pool} W={w} x{nodes} node(s)"
                                    + (f", task events on ({res['events_per_op']} per op)" if events else "")
                                    + ": "
                                    f"{res['ops_per_s']:.0f} ops/s (submit {res['submit_s']:.2f}s of "
                                    f"{res['seconds']:.2f}s; effects {res['effects']}, dups {res['duplicates']}; "
                                    f"RSS {res['rss_kib']}); CPU ms/op {res['cpu_ms_per_op']}; "
                                    f"PostgreSQL's by role {res['postgres_cpu_ms_per_op_by_role']}; machine {res['machine_per_op']}",
                                    flush=True,
                                )
                            res = run_bare(bare_env, tmp, pool, w, n, args.timeout)
                            runs.append(res)
                            print(
                                f"[{rep + 1}/{repeats}] bare   {pool} W={w}: {res['ops_per_s']:.0f} ops/s "
                                f"(publish {res['publish_s']:.2f}s; RSS {res['rss_kib']}); CPU ms/op {res['cpu_ms_per_op']}; "
                                f"machine {res['machine_per_op']}",
                                flush=True,
                            )
                            if not args.no_naive:
                                res = run_naive(naive_env, dsn, tmp, pool, w, n, args.timeout)
                                runs.append(res)
                                print(
                                    f"[{rep + 1}/{repeats}] naive  {pool} W={w}: {res['ops_per_s']:.0f} ops/s "
                                    f"(submit {res['submit_s']:.2f}s; RSS {res['rss_kib']}); CPU ms/op {res['cpu_ms_per_op']}; "
                                    f"machine {res['machine_per_op']}",
                                    flush=True,
                                )
            finally:
                ob.stop_relay()
                ob.engine.dispose()
    finally:
        keys = list(r.scan_iter(match=f"{root}*", count=1000)) + list(
            r.scan_iter(match=f"agent-outbox:breaker:{root}*", count=1000)
        )
        if keys:
            r.delete(*keys)
    rows = summarise(runs)
    print_table(rows, n, repeats)
    print_events(rows)
    grown = scale_out(runs)
    if len({r["nodes"] for r in grown}) > 1:
        print("\nscale-out (outbox): worker nodes -> median ops/s, CPU ms per operation (all / workers / PostgreSQL)")
        for r in grown:
            print(
                f"{r['pool']:8} {r['workers']:>2} x{r['nodes']} node(s) {r['ops_per_s']:>8.0f} ops/s   "
                f"{r['cpu_ms_per_op']:.2f} / {r['workers_cpu_ms_per_op']:.2f} / {r['postgres_cpu_ms_per_op']:.2f}"
            )
    print(
        "(RSS = median VmRSS of each task-executing process after the run; USS = its own pages, not shared "
        "with its parent or siblings; bare Celery's in brackets)"
    )
    out = {
        "benchmark": "pipeline",
        "command": "python -m bench.pipeline_bench " + " ".join(argv or sys.argv[1:]),
        "ops": n,
        "repeats": repeats,
        "submit_batch": args.submit_batch,
        "submitters": args.submitters,
        "presubmit": args.presubmit,
        "slow": args.slow,
        "bare_events": args.bare_events,
        "task_events": args.task_events,
        "cpu_quota": args.cpu_quota,
        "environment": env,
        "summary": rows,
        "scale_out": grown,
        "runs": runs,
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    suffix = (
        ("-quick" if args.quick else "")
        + ("-presubmit" if args.presubmit else "")
        + ("-bare-events" if args.bare_events else "")
        + (f"-events-{args.task_events}" if args.task_events != "off" else "")
        + (f"-submitters{args.submitters}" if args.submitters != 1 else "")
        + (f"-slow{args.slow:g}" if args.slow else "")
        + (f"-quota{args.cpu_quota:g}" if args.cpu_quota else "")
        + (f"-{args.tag}" if args.tag else "")
    )
    path = RESULTS_DIR / f"pipeline-{dt.date.today().isoformat()}{suffix}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if all(r["effects_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
