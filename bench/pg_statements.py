"""What PostgreSQL spends per operation, statement by statement (issue 35: <= 0.5 ms of database CPU
per operation).

Starts a PostgreSQL cluster of its own (``bench.soak.StockCluster``: initdb, stock settings) with
``pg_stat_statements`` preloaded, runs ``bench.pipeline_bench`` against it (outbox and bare Celery,
``--ops`` operations submitted while the pipeline runs), then prints every statement the ledger sent
at least once per 20 operations: calls per operation, rows per call, mean execution time, and its
share of the database's execution time; and the database's CPU per operation as the pipeline bench
measured it (/proc, every ``postgres`` process).

    .venv/bin/python -m bench.pg_statements [--ops 2000] [--submit-batch N] [--presubmit]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.pg_cluster import StockCluster  # noqa: E402

TOP = """
SELECT calls, rows, total_exec_time, mean_exec_time, plans, total_plan_time,
       regexp_replace(query, '\\s+', ' ', 'g') AS query
FROM pg_stat_statements
WHERE (calls >= %(min_calls)s OR rows >= %(min_calls)s) AND query NOT ILIKE '%%pg_stat_statements%%'
ORDER BY total_exec_time DESC
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--submit-batch", type=int, default=1, help="intents per submit transaction (pipeline_bench's)")
    p.add_argument(
        "--presubmit",
        action="store_true",
        help="a backlog: every intent written before the relay starts (pipeline_bench's)",
    )
    p.add_argument(
        "--cpu-quota",
        type=float,
        default=0.0,
        help="pipeline_bench under a cgroup CPU quota of this many CPUs (its --cpu-quota; the cluster stays outside)",
    )
    p.add_argument("--tag", default="", help="appended to the results file's name (runs of one day)")
    a = p.parse_args(argv)
    with StockCluster(
        "shared_preload_libraries=pg_stat_statements",
        "pg_stat_statements.track=all",
        "pg_stat_statements.track_planning=on",
    ) as admin:
        libpq = admin.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        cmd = [sys.executable, "-m", "bench.pipeline_bench", "--ops", str(a.ops), "--workers", "2"]
        tag = "pg-statements" + (f"-{a.tag}" if a.tag else "")
        cmd += ["--pools", "prefork", "--repeats", "1", "--no-naive", "--tag", tag]
        cmd += ["--submit-batch", str(a.submit_batch)] if a.submit_batch != 1 else []
        cmd += ["--presubmit"] if a.presubmit else []
        cmd += ["--cpu-quota", f"{a.cpu_quota:g}"] if a.cpu_quota else []
        print("$", " ".join(cmd[1:]), flush=True)
        stats = ROOT / "bench" / "results" / f".table-stats-{os.getpid()}.jsonl"
        stats.unlink(missing_ok=True)
        env = os.environ | {"OUTBOX_BENCH_PG_URL": admin, "OUTBOX_BENCH_TABLE_STATS": str(stats)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, text=True)
        if done.returncode != 0:
            return done.returncode
        operations = a.ops + 4  # and the warm-up's 2 per worker
        with psycopg.connect(libpq, autocommit=True) as conn:
            rows = conn.execute(TOP, {"min_calls": max(1, operations // 20)}).fetchall()
            total_ms, plan_ms = conn.execute(
                "SELECT sum(total_exec_time), sum(total_plan_time) FROM pg_stat_statements"
            ).fetchone()
            # The relay's planner statistics (outbox/ledger/planner_stats.py): a few calls, each costly.
            calls, spent = conn.execute(
                "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0) FROM pg_stat_statements"
                " WHERE query ILIKE 'analyze%%'"
            ).fetchone()
            analyzes, analyze_ms = int(calls), float(spent)  # sum() of bigints is numeric: a Decimal
    print(f"\nPostgreSQL execution time per operation: {total_ms / operations:.3f} ms (all statements)")
    print(f"  of which ANALYZE: {analyze_ms / operations:.3f} ms ({analyzes} calls, {analyze_ms:.0f} ms in all)")
    # Planning: a statement psycopg has prepared runs on PostgreSQL's cached plan (plans < calls).
    print(f"PostgreSQL planning time per operation: {plan_ms / operations:.3f} ms (all statements)")
    print(f"{'calls/op':>8} {'rows/call':>9} {'ms/call':>8} {'share':>6} {'plans/call':>10} {'plan ms':>7}  statement")
    out = []
    for calls, nrows, total, mean, plans, plan_total, query in rows:
        share = total / total_ms if total_ms else 0.0
        plan_mean = plan_total / plans if plans else 0.0
        print(
            f"{calls / operations:8.2f} {nrows / calls:9.2f} {mean:8.3f} {share:6.1%} {plans / calls:10.2f}"
            f" {plan_mean:7.3f}  {query[:130]}"
        )
        out.append(
            {
                "calls_per_op": round(calls / operations, 3),
                "rows_per_call": round(nrows / calls, 2),
                "mean_ms": round(mean, 4),
                "share": round(share, 4),
                "plans_per_call": round(plans / calls, 3),
                "plan_mean_ms": round(plan_mean, 4),
                "query": query,
            }
        )
    tables = _table_writes(stats)
    print(f"\n{'table':<28} {'inserts/op':>10} {'updates/op':>10} {'of them HOT':>11} {'deletes/op':>10}")
    writes = []
    for relname, ins, upd, hot, dels in tables:
        print(
            f"{relname:<28} {ins / operations:10.2f} {upd / operations:10.2f} {hot / operations:11.2f} {dels / operations:10.2f}"
        )
        writes.append(
            {
                "table": relname,
                "inserts_per_op": round(ins / operations, 3),
                "updates_per_op": round(upd / operations, 3),
                "hot_updates_per_op": round(hot / operations, 3),
                "deletes_per_op": round(dels / operations, 3),
            }
        )
    mode = ("-presubmit" if a.presubmit else "") + (f"-quota{a.cpu_quota:g}" if a.cpu_quota else "")
    name = f"pg-statements-{dt.date.today().isoformat()}{mode}{'-' + a.tag if a.tag else ''}.json"
    path = ROOT / "bench" / "results" / name
    path.write_text(
        json.dumps(
            {
                "ops": a.ops,
                "cpu_quota": a.cpu_quota or None,
                "presubmit": a.presubmit,
                "exec_ms_per_op": total_ms / operations,
                "plan_ms_per_op": plan_ms / operations,
                "analyze_calls": analyzes,
                "analyze_ms_per_op": analyze_ms / operations,
                "statements": out,
                "row_writes": writes,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"written: {path.relative_to(ROOT)}")
    return 0


def _table_writes(path: Path) -> list[tuple[str, int, int, int, int]]:
    """The outbox run's row writes per table, as its scratch database recorded them before it was
    dropped (bench/scratch_database.py); summed if there were several."""
    sums: dict[str, list[int]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            for relname, *counts in json.loads(line)["tables"]:
                sums[relname] = [a + b for a, b in zip(sums.get(relname, [0, 0, 0, 0]), counts, strict=True)]
        path.unlink()
    return [(name, *counts) for name, counts in sorted(sums.items())]  # type: ignore[misc]


if __name__ == "__main__":
    sys.exit(main())
