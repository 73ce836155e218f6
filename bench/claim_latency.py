"""Claim latency with a big table: claim_due(limit=1) + finalize at 10k and at 1M finished rows.

For each size N, in its own throwaway database (``bench/scratch_database.py``: created, migrated,
dropped even on Ctrl-C):

1. bulk-load N finished operations (``INSERT ... SELECT generate_series``, status ``succeeded``)
   with one dispatch attempt row each (``--no-attempts`` to skip those), then D due
   ``not_dispatched`` rows (default 1000), then ``ANALYZE``;
2. ``EXPLAIN`` the claim's due subquery (the statement ``outbox.ledger.claims`` sends, as a SELECT ... FOR
   UPDATE SKIP LOCKED) and check that it reads the partial index of due rows (``DUE_INDEX``);
3. ``CHECKPOINT``, so the load's dirty pages are not written out while claims are timed;
4. time K claims (default 1,000), each = ``claim_due(limit=1)`` in one transaction (a SQLAlchemy
   session, as the reconciler claims; a worker's dispatch claims on its own autocommit connection)
   + ``finalize_if_fenced(..., to=succeeded)`` in another; report p50/p99/max of the claim and of
   claim+finalize, in ms, after a short warm-up.

Every size is loaded first, then the sizes take turns claim by claim: a p99 is the 1% slowest
claims, and timing one size after the other gave each size a different minute of the machine
(bench-full's 1.48x came from a 1M run right after the liveness bench, 0.94x when run alone).

    .venv/bin/python -m bench.claim_latency [--rows 10000,1000000] [--due N] [--claims 1000] [--quick]

``--quick``: 10k and 100k rows, 200 claims. Writes bench/results/claim-latency-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.scratch_database import ScratchDatabase, libpq
from outbox.ledger.models import ATTEMPTS, OPERATIONS

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DUE_INDEX = f"ix_{OPERATIONS}_due"

_FINISHED = f"""
INSERT INTO {OPERATIONS} (
    id, tenant, idempotency_key, action, args, args_digest, subject, status, reason,
    fencing_token, attempt_count, max_attempts, deadline_at, next_attempt_at, result_reference,
    cancel_requested, proven_absent_through, published_at, created_at, updated_at, finished_at)
SELECT 'done-' || lpad(g::text, 10, '0'), 'bench', 'done-' || g, 'refund',
       '{{"amount":"12.50","currency":"eur","order_id":"ord-' || g || '"}}',
       md5(g::text) || md5(g::text), 'agent-bench', 'succeeded', 'bench',
       1, 1, 5, now() - interval '1 day',
       -- finished rows keep their old due time: spread over the past month
       now() - interval '30 days' + g * interval '1 second',
       're_' || g, false, 0, now() - interval '30 days', now() - interval '30 days',
       now() - interval '30 days', now() - interval '30 days'
FROM generate_series(1, %(n)s) AS g
"""

_FINISHED_ATTEMPTS = f"""
INSERT INTO {ATTEMPTS} (operation_id, attempt_number, kind, fencing_token, worker, started_at, ended_at,
                      status_code, attempt_class, provider_reference, latency_s, stale)
SELECT 'done-' || lpad(g::text, 10, '0'), 1, 'dispatch', 1, 'bench', now() - interval '30 days',
       now() - interval '30 days', 200, 'succeeded', 're_' || g, 0.01, false
FROM generate_series(1, %(n)s) AS g
"""

_DUE = f"""
INSERT INTO {OPERATIONS} (
    id, tenant, idempotency_key, action, args, args_digest, subject, status, reason,
    fencing_token, attempt_count, max_attempts, deadline_at, next_attempt_at,
    cancel_requested, proven_absent_through, created_at, updated_at)
SELECT gen_random_uuid()::text, 'bench', 'due-' || g, 'refund',
       '{{"amount":"12.50","currency":"eur","order_id":"ord-' || g || '"}}',
       md5(g::text) || md5(g::text), 'agent-bench', 'not_dispatched', 'submitted',
       0, 0, 5, now() + interval '1 hour', now() - interval '1 hour' + g * interval '1 millisecond',
       false, 0, now(), now()
FROM generate_series(1, %(d)s) AS g
"""

# The due subquery of the PostgreSQL driver's claim (outbox/ledger/drivers/sql/claim.sql, a dispatch of due rows,
# no operation id), bound.
_EXPLAIN = f"""
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
SELECT id FROM {OPERATIONS}
WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp()
  AND (false OR lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
  AND (CAST(NULL AS varchar) IS NULL OR id = NULL)
ORDER BY next_attempt_at
LIMIT 1
FOR UPDATE SKIP LOCKED
"""


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def load(url: str, rows: int, due: int, attempts: bool) -> dict[str, float]:
    import psycopg

    timings: dict[str, float] = {}
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        t = time.perf_counter()
        conn.execute(_FINISHED, {"n": rows})
        timings["load_operations_s"] = time.perf_counter() - t
        if attempts:
            t = time.perf_counter()
            conn.execute(_FINISHED_ATTEMPTS, {"n": rows})
            timings["load_attempts_s"] = time.perf_counter() - t
        conn.execute(_DUE, {"d": due})
        t = time.perf_counter()
        conn.execute(f"VACUUM ANALYZE {OPERATIONS}")
        conn.execute(f"VACUUM ANALYZE {ATTEMPTS}")
        timings["vacuum_analyze_s"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            timings["checkpoint_s"] = -1.0  # not a superuser: the load's pages may be written while timing
        else:
            timings["checkpoint_s"] = time.perf_counter() - t
        size = conn.execute(f"SELECT pg_total_relation_size('{OPERATIONS}') / 1048576.0").fetchone()
        timings["table_mb"] = float(size[0]) if size else 0.0
    return timings


def explain(url: str) -> list[str]:
    import psycopg

    with psycopg.connect(libpq(url)) as conn:
        plan = [r[0] for r in conn.execute(_EXPLAIN).fetchall()]
        conn.rollback()
    return plan


def measure(urls: list[str], claims: int, warmup: int = 20) -> list[tuple[list[float], list[float]]]:
    """Per database, ``claims`` timed claim (and claim + finalize) latencies in ms after ``warmup``
    untimed ones; the databases take turns claim by claim, so a burst of machine noise lands on all."""
    from outbox.ledger.claims import claim_due
    from outbox.ledger.db import make_engine, make_sessionmaker
    from outbox.ledger.states import AttemptClass, Status
    from outbox.ledger.transitions import AttemptReport, finalize_if_fenced

    engines = [make_engine(url, pool_size=1, max_overflow=0) for url in urls]
    makers = [make_sessionmaker(engine) for engine in engines]
    report = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_x")
    timed: list[tuple[list[float], list[float]]] = [([], []) for _ in urls]
    try:
        for i in range(warmup + claims):
            for sessions, (claim_ms, total_ms) in zip(makers, timed, strict=True):
                t0 = time.perf_counter()
                with sessions.begin() as s:
                    got = claim_due(s, worker="bench", lease_s=60.0, limit=1)
                t1 = time.perf_counter()
                if not got:
                    raise RuntimeError(f"nothing due after {i} claims: raise --due")
                with sessions.begin() as s:
                    finalize_if_fenced(s, got[0], report, to=Status.SUCCEEDED, reason="bench")
                t2 = time.perf_counter()
                if i >= warmup:
                    claim_ms.append((t1 - t0) * 1000)
                    total_ms.append((t2 - t0) * 1000)
    finally:
        for engine in engines:
            engine.dispose()
    return timed


def stats(v: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(v), "p99": pct(v, 99), "max": max(v), "mean": statistics.fmean(v)}


def run_all(sizes: list[int], due: int, claims: int, attempts: bool) -> list[dict[str, Any]]:
    """Load every size, then time ``claims`` claims per size, the sizes taking turns claim by claim."""
    with ExitStack() as stack:
        dbs = [stack.enter_context(ScratchDatabase()) for _ in sizes]
        results: list[dict[str, Any]] = []
        for n, db in zip(sizes, dbs, strict=True):
            print(f"claim-latency: loading {n:,} finished rows ...", flush=True)
            result: dict[str, Any] = {"rows": n, "due": due, "attempt_rows": attempts}
            result["load"] = load(db.url, n, due, attempts)
            plan = explain(db.url)
            result["explain"] = plan
            result["uses_ix_operations_due"] = any(DUE_INDEX in line for line in plan)
            results.append(result)
        print(f"claim-latency: timing {claims:,} claims per size, the sizes in turn ...", flush=True)
        for result, (c, cf) in zip(results, measure([db.url for db in dbs], claims), strict=True):
            result.update({"claims": len(c), "claim_ms": stats(c), "claim_finalize_ms": stats(cf)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated sizes (default 10000,1000000)")
    parser.add_argument("--due", type=int, default=1000)
    parser.add_argument("--claims", type=int, default=None, help="timed claims per size (default 1000; --quick 200)")
    parser.add_argument("--no-attempts", action="store_true", help="do not load attempt rows for finished operations")
    parser.add_argument("--quick", action="store_true", help="10k and 100k rows, 200 claims")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(x) for x in (args.rows or ("10000,100000" if args.quick else "10000,1000000")).split(",")]
    claims = args.claims or (200 if args.quick else 1000)
    if claims + 20 > args.due:  # 20 untimed claims warm up each size
        args.due = claims + 20

    results = run_all(sizes, args.due, claims, not args.no_attempts)
    for r in results:
        n = r["rows"]
        load_s = r["load"]["load_operations_s"] + r["load"].get("load_attempts_s", 0.0)
        c, cf = r["claim_ms"], r["claim_finalize_ms"]
        print(
            f"claim-latency rows={n} due={args.due} claims={claims} load={load_s:.1f}s "
            f"table={r['load']['table_mb']:.0f}MB claim p50={c['p50']:.2f}ms p99={c['p99']:.2f}ms "
            f"max={c['max']:.2f}ms claim+finalize p50={cf['p50']:.2f}ms p99={cf['p99']:.2f}ms "
            f"{DUE_INDEX}={'yes' if r['uses_ix_operations_due'] else 'NO'}",
            flush=True,
        )
    if len(results) > 1:
        small, big = min(results, key=lambda r: r["rows"]), max(results, key=lambda r: r["rows"])
        ratio = big["claim_ms"]["p99"] / small["claim_ms"]["p99"]
        print(
            f"claim p99 at {big['rows']:,} rows / at {small['rows']:,}: {ratio:.2f}x (goal <= 1.2x); "
            f"p50 {big['claim_ms']['p50'] / small['claim_ms']['p50']:.2f}x",
            flush=True,
        )
    biggest = results[-1]
    print(f"\nEXPLAIN (ANALYZE) of the claim's due subquery at {biggest['rows']} rows:")
    for line in biggest["explain"]:
        print(f"  {line}")
    out = args.out or RESULTS_DIR / f"claim-latency-{dt.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": dt.datetime.now(dt.UTC).isoformat(), "results": results}, indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r["uses_ix_operations_due"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
