"""The soak: a steady arrival rate for minutes under the fault mix, a dispatch worker killed every
two minutes, on a PostgreSQL cluster of its own with stock settings (autovacuum on).

Issue 35's goals, each printed as met or not:

- settle latency (submit to a final state) p99 of the last third of the arrivals within 1.5x of the
  first third's: nothing accumulates (bloat, a leak, a queue that grows);
- the workers' RSS per process grows < 10% from the first third to the last (the reconciler is never
  killed; a dispatch worker's replacement starts afresh, so its growth shows within two minutes);
- the backlog when arrivals stop < 15 s of arrivals;
- 0 lost, 0 duplicate effects, 0 untrue states (scale_proof's invariants, against the provider).

And stated, not judged: the database's size per 100,000 operations (above the empty migrated
ledger's), and what ``purge`` (arguments
and provider responses of finished operations) brings back, after a plain VACUUM (space PostgreSQL
reuses) and after VACUUM FULL (the files' own size).

The load itself is ``tests/loads/reconcile_soak.py``'s (its ``run_soak``): intents at ``--rate`` per
second from one submitter, the provider's first-request fault mix (resets, 504s, stalls and
truncated bodies after commit, 503/429, 500), lookups ``--lookup-latency-ms`` slow, two dispatch
workers (prefork -c 2), one reconciler, a private Redis.

This machine kind's shared PostgreSQL runs with autovacuum off (a CI setting), so by default the
soak ``initdb``s its own cluster in a temporary folder (as the ``postgres`` user when run as root),
on a free port, and removes it afterwards; ``--shared-cluster`` uses OUTBOX_BENCH_PG_URL's instead.

    .venv/bin/python -m bench.soak [--rate 40] [--duration 600] [--kill-every 120] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads.reconcile_soak import SoakResult, rss_growth, run_soak  # noqa: E402
from tests.pg_cluster import StockCluster  # noqa: E402

GOAL_SETTLE_RATIO = 1.5
GOAL_RSS_GROWTH = 0.10
GOAL_BACKLOG_S = 15.0


def _sizes(engine: Any) -> dict[str, int]:
    """The database's size and each outbox table's (with its indexes and TOAST), in bytes."""
    from sqlalchemy import text

    with engine.connect() as conn:
        out = {"database": int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one())}
        for name, size in conn.execute(
            text(
                "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables "
                "WHERE relname LIKE 'outbox%' ORDER BY 2 DESC"
            )
        ):
            out[str(name)] = int(size)
    return out


def _vacuum(engine: Any, full: bool) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM FULL" if full else "VACUUM")


def _autovacuum(engine: Any) -> dict[str, Any]:
    from sqlalchemy import text

    with engine.connect() as conn:
        on = conn.execute(text("SHOW autovacuum")).scalar_one()
        rows = conn.execute(
            text(
                "SELECT relname, autovacuum_count, autoanalyze_count, n_dead_tup FROM pg_stat_user_tables "
                "WHERE relname LIKE 'outbox%' AND (autovacuum_count > 0 OR autoanalyze_count > 0 OR n_dead_tup > 0)"
            )
        ).all()
    return {"autovacuum": on, "tables": {r[0]: {"autovacuum": r[1], "autoanalyze": r[2], "dead": r[3]} for r in rows}}


def goals(result: SoakResult) -> dict[str, dict[str, Any]]:
    first, last = result.settle_p99_s.get("first", 0.0), result.settle_p99_s.get("last", 0.0)
    growth = rss_growth(result.rss, result.duration_s)
    at_stop = next((x for x in result.samples if x.t >= result.duration_s), None)
    backlog = (at_stop.submitted - at_stop.settled) if at_stop else None
    backlog_s = backlog / result.rate if backlog is not None else None
    return {
        "settle_p99_last_over_first": {
            "value": round(last / first, 2) if first else None,
            "goal": f"<= {GOAL_SETTLE_RATIO}",
            "met": bool(first) and last / first <= GOAL_SETTLE_RATIO,
            "first_s": round(first, 2),
            "last_s": round(last, 2),
        },
        "rss_growth": {
            "value": {k: round(v, 3) for k, v in growth.items()},
            "goal": f"< {GOAL_RSS_GROWTH:.0%} per kind",
            "met": bool(growth) and all(v < GOAL_RSS_GROWTH for v in growth.values()),
        },
        "backlog_at_stop_s": {
            "value": None if backlog_s is None else round(backlog_s, 1),
            "operations": backlog,
            "goal": f"< {GOAL_BACKLOG_S:g} s of arrivals",
            "met": backlog_s is not None and backlog_s < GOAL_BACKLOG_S,
        },
        "invariants": {
            "value": {
                "lost": result.scale.lost,
                "duplicates": result.scale.duplicates,
                "violations": len(result.scale.violations),
            },
            "goal": "0 lost, 0 duplicates, 0 untrue states",
            "met": not result.scale.lost and not result.scale.duplicates and not result.scale.violations,
        },
    }


def _mib(n: int) -> str:
    return f"{n / 1048576:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=40.0, help="intents per second (default 40)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals (default 600)")
    p.add_argument("--kill-every", type=float, default=120.0, help="SIGKILL a dispatch worker this often (0: never)")
    p.add_argument("--lookup-latency-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="60 s of arrivals, a kill every 30 s (a smoke run)")
    p.add_argument("--shared-cluster", action="store_true", help="OUTBOX_BENCH_PG_URL's cluster, not one of its own")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.kill_every = 60.0, 30.0

    from contextlib import nullcontext

    from bench.scratch_database import ADMIN_URL, ScratchDatabase
    from outbox.ledger.db import make_engine, make_sessionmaker
    from outbox.privacy.retention import purge
    from workers.sandbox.testing import SandboxProcess

    print(
        f"soak: {a.rate:g}/s for {a.duration:g} s, a dispatch worker killed every {a.kill_every:g} s, "
        f"{'the shared cluster' if a.shared_cluster else 'a stock cluster of its own'}",
        flush=True,
    )
    cluster = nullcontext(ADMIN_URL) if a.shared_cluster else StockCluster()
    with (
        cluster as admin_url,
        ScratchDatabase(admin_url) as db,
        tempfile.TemporaryDirectory(prefix="soak-") as tmp,
        SandboxProcess("--seed", str(a.seed)) as sandbox,
    ):
        engine = make_engine(db.url)
        try:
            vacuum_settings = _autovacuum(engine)["autovacuum"]
            empty = _sizes(engine)  # migrated, no rows: what a ledger costs before its first operation
            kills = (
                tuple(a.kill_every * k for k in range(1, int(a.duration // a.kill_every) + 1)) if a.kill_every else ()
            )
            result = run_soak(
                db_url=db.url,
                sessions=make_sessionmaker(engine),
                sandbox=sandbox,
                tmp=Path(tmp),
                rate=a.rate,
                duration_s=a.duration,
                seed=a.seed,
                lookup_latency_ms=a.lookup_latency_ms,
                kill_at_s=kills,
                verbose=True,
            )
            operations = result.scale.intents
            print("measuring the database ...", flush=True)
            sizes = {"empty (migrated)": empty, "after the run": _sizes(engine)}
            autovacuum = _autovacuum(engine)
            time.sleep(1.1)
            purged = purge(make_sessionmaker(engine), older_than_s=1.0)
            _vacuum(engine, full=False)
            sizes["after purge + VACUUM"] = _sizes(engine)
            _vacuum(engine, full=True)
            sizes["after purge + VACUUM FULL"] = _sizes(engine)
        finally:
            engine.dispose()
    judged = goals(result)
    # Per 100k operations: what the rows added to the empty ledger, scaled.
    per_100k = {
        k: (v["database"] - empty["database"]) * 100_000 / max(operations, 1)
        for k, v in sizes.items()
        if k != "empty (migrated)"
    }
    print(result.summary())
    for name, g in judged.items():
        print(f"{'MET    ' if g['met'] else 'NOT MET'} {name}: {g['value']} (goal {g['goal']})")
    print(f"database empty (migrated): {_mib(empty['database'])}")
    for k, v in per_100k.items():
        print(
            f"database {k}: {_mib(sizes[k]['database'])} for {operations} operations: {_mib(int(v))} per 100k above empty"
        )
    print(f"purge: {purged.operations} operations' arguments and responses removed; autovacuum={vacuum_settings}")
    for line in result.scale.violations[:30]:
        print(f"VIOLATION {line}")
    out = a.out or ROOT / "bench" / "results" / f"soak-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "goals": judged,
                "sizes": sizes,
                "bytes_per_100k_operations": per_100k,
                "purged_operations": purged.operations,
                "autovacuum": autovacuum,
                "cluster": "shared" if a.shared_cluster else "own (initdb, stock settings)",
                "run": result.as_json(),
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"written: {out}")
    return 0 if all(g["met"] for g in judged.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
