"""Ledger throughput on PostgreSQL, each figure beside a bare psycopg loop in the same run.

Measures, in a throwaway database (created, migrated, dropped even on Ctrl-C):

1. submit: intents/s with ``outbox.ledger.submit.submit``, one intent per transaction and batched;
2. claim+finalize: operations/s with 1, 2 and 4 worker processes draining a pre-filled backlog
   through ``claim_due`` + ``finalize_if_fenced`` (two transactions per operation), beside a bare
   ``FOR UPDATE SKIP LOCKED`` loop with the same two commits on a table of the same shape, and
   the ledger/bare ratio;
3. commits per operation from submit to finalize, counted by PostgreSQL
   (``pg_stat_database.xact_commit``), and the write transactions among them (transaction ids).

    .venv/bin/python -m bench.ledger_bench [--quick] [--processes 1 2 4] [--ops 1500] ...

Prints a table and writes bench/results/ledger-<date>.json (ledger-<date>-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psycopg

from bench import backlog
from bench.commit_count import settled_xacts
from bench.drain import DrainResult, drain
from bench.scratch_database import ScratchDatabase, libpq

RESULTS_DIR = Path(__file__).resolve().parent / "results"

QUICK: dict[str, Any] = dict(
    submit_single=400, submit_batched=1000, ops=1000, repeats=1, commit_ops=300, claim_limits=[1], variants=False
)
FULL: dict[str, Any] = dict(
    submit_single=2000, submit_batched=10000, ops=1500, repeats=3, commit_ops=1000, claim_limits=[1, 10], variants=True
)


# ---- submit -------------------------------------------------------------------------------------


def _intent(i: int, run: str) -> dict[str, Any]:
    return dict(
        tenant="bench",
        idempotency_key=f"{run}:refund-{i}",
        action="refund",
        args={"order_id": f"ord-{i}", "amount": "12.50", "currency": "eur"},
        subject="agent-bench",
    )


def bench_submit(url: str, n: int, batch: int, run: str, pre_ping: bool = False, warmup: int = 20) -> float:
    """Intents per second, ``batch`` submits per transaction, in this process (one connection)."""
    from outbox.ledger.db import make_engine, make_sessionmaker
    from producer import submit

    engine = make_engine(url, pool_size=1, max_overflow=0, pool_pre_ping=pre_ping)
    sessions = make_sessionmaker(engine)
    with engine.connect():  # the dialect's first-connect queries, also when nothing is submitted
        pass
    for i in range(warmup):  # connect and warm the statement cache outside the measured span
        with sessions.begin() as s:
            submit(s, **_intent(i, f"{run}-warm"))
    started = time.perf_counter()
    for first in range(0, n, batch):
        with sessions.begin() as s:
            for i in range(first, min(first + batch, n)):
                submit(s, **_intent(i, run))
    seconds = time.perf_counter() - started
    engine.dispose()
    return n / seconds


# ---- commits ------------------------------------------------------------------------------------


def _next_xid(admin: psycopg.Connection) -> int:
    # The next transaction id to be handed out; reading it assigns none. Cluster-wide: counts
    # only the transactions that wrote something (read-only ones never get an id).
    (xid,) = admin.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()  # type: ignore[misc]
    return int(xid)


def _commits_of_run(db: ScratchDatabase, admin: psycopg.Connection, k: int, pre_ping: bool) -> dict[str, Any]:
    """Commits counted while k intents are submitted one per transaction, then drained by one worker."""
    with psycopg.connect(libpq(db.url), autocommit=True) as conn:
        backlog.refill(conn, backlog.LEDGER_TABLE, 0, "none")
    x0, id0 = settled_xacts(admin, db.name), _next_xid(admin)
    bench_submit(db.url, k, 1, f"commits-{pre_ping}-{k}", pre_ping=pre_ping, warmup=0)
    x1, id1 = settled_xacts(admin, db.name), _next_xid(admin)
    result = drain(db.url, "ledger", processes=1, claim_limit=1, pre_ping=pre_ping)
    x2, id2 = settled_xacts(admin, db.name), _next_xid(admin)
    (finished,) = conn_count(db, f"SELECT count(*) FROM {backlog.LEDGER_TABLE} WHERE status = 'succeeded'")
    if result.ops != k or finished != k:
        raise RuntimeError(f"commit count run: drained {result.ops}, succeeded {finished}, expected {k}")
    return {"submit": x1 - x0, "drain": x2 - x1, "xids_submit": id1 - id0, "xids_drain": id2 - id1, "end": x2}


def count_commits(db: ScratchDatabase, k: int, pre_ping: bool) -> dict[str, Any]:
    """Commits per operation, submit -> claim -> finalize: a run of 2k operations minus a run of k.

    Each run also pays a few commits whatever its size: the engine's first connect, the worker's
    warm-up claim and its last, empty claim, and one per statement psycopg prepares (a Parse
    outside a transaction is a transaction of its own; each statement is prepared once per
    connection, after 5 executions). The difference between two runs cancels those, so it counts
    what each further operation costs; the fixed part is reported beside it.
    """
    with db.admin() as admin:
        fixed = _commits_of_run(db, admin, k, pre_ping)
        run = _commits_of_run(db, admin, 2 * k, pre_ping)
        time.sleep(2.0)  # nothing runs now: anything counted is background noise
        idle = settled_xacts(admin, db.name) - run["end"]
    submit_x, drain_x = run["submit"] - fixed["submit"], run["drain"] - fixed["drain"]
    return {
        "ops": k,
        "pool_pre_ping": pre_ping,
        "submit_commits_per_op": submit_x.commits / k,
        "claim_finalize_commits_per_op": drain_x.commits / k,
        "commits_per_op": (submit_x.commits + drain_x.commits) / k,
        "fixed_commits_per_run": 2 * (fixed["submit"].commits + fixed["drain"].commits)
        - (run["submit"].commits + run["drain"].commits),
        # Transaction ids are cluster-wide: other databases' writes land here too. Meaningful only
        # on an otherwise idle server; kept for that case, not reported in the table.
        "cluster_write_xacts_per_op": (
            run["xids_submit"] + run["xids_drain"] - fixed["xids_submit"] - fixed["xids_drain"]
        )
        / k,
        "rollbacks_per_run": (run["submit"] + run["drain"]).rollbacks,
        "idle_commits_2s": idle.commits,
        "raw": {
            "run_2k": {"submit": asdict(run["submit"]), "drain": asdict(run["drain"])},
            "half_run": {"submit": asdict(fixed["submit"]), "drain": asdict(fixed["drain"])},
        },
    }


def conn_count(db: ScratchDatabase, sql: str) -> tuple[Any, ...]:
    with psycopg.connect(libpq(db.url), autocommit=True) as conn:
        return conn.execute(sql).fetchone()  # type: ignore[return-value]


# ---- claim + finalize ---------------------------------------------------------------------------


def drain_once(
    db: ScratchDatabase, loop: str, m: int, processes: int, limit: int, pre_ping: bool, batch: str
) -> DrainResult:
    table = backlog.BARE_TABLE if loop.startswith("bare") and loop != "bare_evidence" else backlog.LEDGER_TABLE
    with psycopg.connect(libpq(db.url), autocommit=True) as conn:
        backlog.refill(conn, table, m, batch)
        conn.execute("CHECKPOINT")  # no checkpoint left over from filling lands inside a timing
    result = drain(db.url, loop, processes=processes, claim_limit=limit, pre_ping=pre_ping)
    (finished,) = conn_count(db, f"SELECT count(*) FROM {table} WHERE status = 'succeeded'")
    if result.ops != m or finished != m:
        raise RuntimeError(f"{loop}: drained {result.ops}, succeeded {finished}, expected {m}")
    return result


def _label(loop: str, pre_ping: bool) -> str:
    # The product's default engine has no pre-ping (outbox/ledger/db.py); the variant shows its cost.
    return "ledger (pre_ping on)" if loop == "ledger" and pre_ping else loop


# ---- machine, report ----------------------------------------------------------------------------


def machine(db: ScratchDatabase) -> dict[str, Any]:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    with db.admin() as admin:
        settings = {
            name: admin.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("server_version", "synchronous_commit", "fsync", "shared_buffers", "autovacuum", "wal_level")
        }
    return {
        "nproc": os.cpu_count(),
        "cpu": sh("lscpu | sed -n 's/^Model name: *//p'"),
        "memory": sh("free -h | awk '/^Mem:/ {print $2}'"),
        "python": platform.python_version(),
        "postgres": settings,
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarise(runs: list[DrainResult]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, int], dict[str, list[float]]] = {}
    for r in runs:
        groups.setdefault((r.processes, r.claim_limit), {}).setdefault(_label(r.loop, r.pre_ping), []).append(
            r.ops_per_s
        )
    rows = []
    for (procs, limit), by_loop in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        bare = _median(by_loop.get("bare", []))
        bare_ac = _median(by_loop.get("bare_autocommit", []))
        row: dict[str, Any] = {"processes": procs, "claim_limit": limit}
        for loop, values in by_loop.items():
            row[loop] = {
                "median_ops_per_s": round(_median(values), 1),
                "runs": [round(v, 1) for v in values],
                "ratio_to_bare": round(_median(values) / bare, 3) if bare else None,
                "ratio_to_bare_autocommit": round(_median(values) / bare_ac, 3) if bare_ac else None,
            }
        rows.append(row)
    return rows


def print_table(submit: dict[str, float], rows: list[dict[str, Any]], commits: list[dict[str, Any]]) -> None:
    print("\nsubmit (one process, one connection)")
    for name, rate in submit.items():
        print(f"  {name:<34} {rate:>8.0f} intents/s")
    print("\nclaim+finalize, ops/s (median; ratios = ledger / bare, ledger / bare_autocommit)")
    loops = ["ledger", "ledger (sessions)", "bare_evidence", "bare", "bare_autocommit"]
    print(
        f"  {'procs':>5} {'limit':>5}  "
        + "  ".join(f"{name:>18}" for name in loops)
        + f"  {'ledger/bare':>11} {'ledger/bare_ac':>14}"
    )
    for row in rows:
        cells = []
        for loop in loops:
            cell = row.get(loop)
            cells.append(f"{cell['median_ops_per_s']:>18.0f}" if cell else f"{'-':>18}")
        ratio = row.get("ledger", {}).get("ratio_to_bare")
        ratio_ac = row.get("ledger", {}).get("ratio_to_bare_autocommit")
        print(
            f"  {row['processes']:>5} {row['claim_limit']:>5}  "
            + "  ".join(cells)
            + f"  {ratio if ratio is not None else '-':>11} {ratio_ac if ratio_ac is not None else '-':>14}"
        )
    print("\ncommits per operation, submit -> claim -> finalize (pg_stat_database.xact_commit)")
    for c in commits:
        print(
            f"  pool_pre_ping={str(c['pool_pre_ping']):<5} commits/op={c['commits_per_op']:.2f} "
            f"(submit {c['submit_commits_per_op']:.2f} + claim/finalize "
            f"{c['claim_finalize_commits_per_op']:.2f}); rollbacks per run={c['rollbacks_per_run']}; "
            f"fixed per run (connect, warm-up, last empty claim, prepares): {c['fixed_commits_per_run']}; "
            f"idle 2 s: {c['idle_commits_2s']} commits"
        )


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one repeat (< ~60 s)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ops", type=int, help="backlog drained per claim+finalize run")
    parser.add_argument("--claim-limits", type=int, nargs="+", help="claim_due(limit=...) values")
    parser.add_argument("--submit-single", type=int, help="intents submitted one per transaction")
    parser.add_argument("--submit-batched", type=int, help="intents submitted in batches")
    parser.add_argument("--batch", type=int, default=100, help="intents per transaction when batched")
    parser.add_argument("--commit-ops", type=int, help="operations in the commit-count run")
    parser.add_argument("--repeats", type=int, help="runs per figure (the median is reported)")
    parser.add_argument(
        "--variants",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the ledger through SQLAlchemy sessions and the bare_evidence loop",
    )
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/ledger-<date>[-quick].json)")
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = dict(QUICK if args.quick else FULL)
    for key in ("ops", "claim_limits", "submit_single", "submit_batched", "commit_ops", "repeats", "variants"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)

    started = time.monotonic()
    when = dt.datetime.now(dt.UTC)
    with ScratchDatabase() as db:
        print(f"database {db.name}; config {cfg}; processes {args.processes}", flush=True)
        with psycopg.connect(libpq(db.url), autocommit=True) as conn:
            backlog.create_bare_table(conn)
        info = machine(db)

        submit_runs: dict[str, list[float]] = {"one per transaction": [], f"batched ({args.batch} per transaction)": []}
        for rep in range(cfg["repeats"]):
            with psycopg.connect(libpq(db.url), autocommit=True) as conn:
                backlog.refill(conn, backlog.LEDGER_TABLE, 0, "none")
            submit_runs["one per transaction"].append(bench_submit(db.url, cfg["submit_single"], 1, f"s{rep}"))
            submit_runs[f"batched ({args.batch} per transaction)"].append(
                bench_submit(db.url, cfg["submit_batched"], args.batch, f"b{rep}")
            )
            print(
                f"submit repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in submit_runs.items()),
                flush=True,
            )
        submit = {k: _median(v) for k, v in submit_runs.items()}

        loops: list[tuple[str, bool]] = [("ledger", False), ("bare", False), ("bare_autocommit", False)]
        runs: list[DrainResult] = []
        for rep in range(cfg["repeats"]):
            for limit in cfg["claim_limits"]:
                plan = loops + (
                    [("ledger (sessions)", False), ("bare_evidence", False)] if cfg["variants"] and limit == 1 else []
                )
                # Rotate the order each repeat so that drift (cache, WAL, a noisy neighbour)
                # does not always land on the same loop.
                plan = plan[rep % len(plan) :] + plan[: rep % len(plan)]
                for procs in args.processes:
                    for loop, pre_ping in plan:
                        r = drain_once(db, loop, cfg["ops"], procs, limit, pre_ping, f"r{rep}")
                        runs.append(r)
                        print(
                            f"  repeat {rep + 1} limit {limit} procs {procs} {_label(loop, pre_ping):<22} "
                            f"{r.ops_per_s:8.0f} ops/s ({r.ops} in {r.seconds:.2f} s)",
                            flush=True,
                        )
        rows = summarise(runs)

        commits = [count_commits(db, cfg["commit_ops"], pre_ping=False)]
        if cfg["variants"]:
            commits.append(count_commits(db, cfg["commit_ops"], pre_ping=True))

    print_table(submit, rows, commits)
    elapsed = time.monotonic() - started
    # A quick run never overwrites the day's full run.
    out = args.out or RESULTS_DIR / f"ledger-{when.date().isoformat()}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": when.isoformat(timespec="seconds"),
                "command": " ".join(
                    [".venv/bin/python -m bench.ledger_bench", *(argv if argv is not None else sys.argv[1:])]
                ),
                "config": cfg | {"processes": args.processes, "batch": args.batch},
                "machine": info,
                "submit_intents_per_s": {
                    k: {"median": round(v, 1), "runs": [round(x, 1) for x in submit_runs[k]]} for k, v in submit.items()
                },
                "claim_finalize": rows,
                "commits": commits,
                "elapsed_s": round(elapsed, 1),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
