"""Overload: intents offered at twice what the fleet settles, under the fault mix, for five minutes.

Issue 35's goal: settled throughput holds at capacity instead of swinging. Two runs on one
PostgreSQL cluster (by default one ``initdb``'d here with stock settings, as ``bench.soak``), the same
fleet and fault mix as the soak (``tests/loads/reconcile_soak.py``'s ``run_soak``: two dispatch workers
prefork -c 2, one reconciler, the provider's first-request mix, lookups ``--lookup-latency-ms`` slow):

1. **capacity**: ``--capacity-ops`` intents submitted at once, then drained; capacity is the
   operations settled per second until 90% of them had settled (the queue full all along, as under
   overload; the tail waits for reconciliation back-offs, not for the fleet);
2. **overload**: intents at ``--factor`` x capacity for ``--duration`` seconds, then drained.

Judged (printed as met or not):

- settled per 10-second window, from 30 s in to the end of the arrivals: the lowest >= 90% of
  capacity;
- the oldest due age (the longest a due ``not_dispatched`` operation has waited for a worker)
  grows linearly: a least-squares line over the same span explains >= 90% of its variance (R^2), and
  its slope is stated against the ``1 - 1/factor`` a fleet settling at capacity gives;
- intake stays responsive: the p99 of the submitter's transactions (one per 50 ms tick, in-process
  ``submit``) in the last third of the arrivals within 2x the first third's (the HTTP API's own answer
  past a backlog, ``OUTBOX_API_MAX_BACKLOG``'s 429, is tested in tests/integration/surfaces/test_api.py);
- once drained: 0 lost, 0 duplicate effects, 0 untrue states (scale_proof's invariants).

Budgets get a deadline of ``--deadline`` (3600 s) so that nothing expires in the queue: an operation
ended by its deadline would count as settled without the fleet having done it.

    .venv/bin/python -m bench.overload [--factor 2] [--duration 300] [--capacity-ops 6000] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads.reconcile_soak import SoakResult, _p99, run_soak  # noqa: E402
from tests.pg_cluster import StockCluster  # noqa: E402

GOAL_WINDOW_SHARE = 0.9
GOAL_R2 = 0.9
GOAL_INTAKE_RATIO = 2.0
WINDOW_S = 10.0
WARM_UP_S = 30.0


def capacity_of(result: SoakResult) -> dict[str, float]:
    """Settled per second from 10% to 90% of the burst settled (not the workers' start, not the tail
    of reconciliation back-offs)."""
    n = result.scale.intents
    a = next((x for x in result.samples if x.settled >= 0.1 * n), None)
    b = next((x for x in result.samples if x.settled >= 0.9 * n), None)
    if a is None or b is None or b.t <= a.t:
        return {"per_s": 0.0, "t10_s": 0.0, "t90_s": 0.0}
    return {"per_s": (b.settled - a.settled) / (b.t - a.t), "t10_s": a.t, "t90_s": b.t}


def windows(result: SoakResult, start_s: float, end_s: float, width_s: float = WINDOW_S) -> list[float]:
    """Operations settled per second in each whole window of ``width_s`` between the two times."""
    out = []
    t = start_s
    while t + width_s <= end_s + 1e-9:
        a = _at(result, t)
        b = _at(result, t + width_s)
        if a is not None and b is not None and b.t > a.t:
            out.append((b.settled - a.settled) / (b.t - a.t))
        t += width_s
    return out


def _at(result: SoakResult, t: float) -> Any:
    """The first sample at or after ``t``."""
    return next((x for x in result.samples if x.t >= t), None)


def linear_fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares y = a + b t: slope b and R^2."""
    n = len(points)
    if n < 3:
        return {"slope": 0.0, "r2": 0.0}
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    stt = sum((t - mt) ** 2 for t, _ in points)
    sty = sum((t - mt) * (y - my) for t, y in points)
    syy = sum((y - my) ** 2 for _, y in points)
    slope = sty / stt if stt else 0.0
    r2 = (sty * sty) / (stt * syy) if stt and syy else 0.0
    return {"slope": slope, "r2": r2}


def intake(result: SoakResult) -> dict[str, float]:
    during = [(t, s) for t, s, _ in result.ticks if t <= result.duration_s]
    third = result.duration_s / 3
    first = [s for t, s in during if t < third]
    last = [s for t, s in during if t >= 2 * third]
    return {"first_p99_s": _p99(first), "last_p99_s": _p99(last), "max_s": max((s for _, s in during), default=0.0)}


def goals(capacity: float, result: SoakResult, factor: float) -> dict[str, dict[str, Any]]:
    span = (WARM_UP_S, result.duration_s)
    rates = windows(result, *span)
    low = min(rates, default=0.0)
    ages = [(x.t, x.dispatch_wait_s) for x in result.samples if span[0] <= x.t <= span[1]]
    fit = linear_fit(ages)
    taken = intake(result)
    ratio = taken["last_p99_s"] / taken["first_p99_s"] if taken["first_p99_s"] else None
    return {
        "settled_per_window": {
            "value": {
                "min": round(low, 1),
                "p10": round(sorted(rates)[len(rates) // 10], 1) if rates else None,
                "median": round(median(rates), 1) if rates else None,
                "max": round(max(rates, default=0.0), 1),
                "min_over_capacity": round(low / capacity, 2) if capacity else None,
            },
            "goal": f">= {GOAL_WINDOW_SHARE:.0%} of capacity ({capacity:.1f}/s) in every {WINDOW_S:g} s window",
            "met": bool(rates) and capacity > 0 and low >= GOAL_WINDOW_SHARE * capacity,
        },
        "oldest_due_age_linear": {
            "value": {
                "r2": round(fit["r2"], 3),
                "slope": round(fit["slope"], 3),
                "slope_at_capacity": round(1 - 1 / factor, 3),
                "at_end_s": round(ages[-1][1], 1) if ages else None,
            },
            "goal": f"R^2 >= {GOAL_R2}",
            "met": fit["r2"] >= GOAL_R2,
        },
        "intake_p99_last_over_first": {
            "value": None if ratio is None else round(ratio, 2),
            "first_p99_ms": round(taken["first_p99_s"] * 1000, 1),
            "last_p99_ms": round(taken["last_p99_s"] * 1000, 1),
            "max_ms": round(taken["max_s"] * 1000, 1),
            "goal": f"<= {GOAL_INTAKE_RATIO:g}",
            "met": ratio is not None and ratio <= GOAL_INTAKE_RATIO,
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


def _run(admin_url: str, sandbox: Any, **kw: Any) -> SoakResult:
    from bench.scratch_database import ScratchDatabase
    from outbox.ledger.db import make_engine, make_sessionmaker

    with ScratchDatabase(admin_url) as db, tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        engine = make_engine(db.url)
        try:
            return run_soak(db_url=db.url, sessions=make_sessionmaker(engine), sandbox=sandbox, tmp=Path(tmp), **kw)
        finally:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factor", type=float, default=2.0, help="offered rate / capacity (default 2)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals (default 300)")
    p.add_argument("--capacity-ops", type=int, default=6000, help="the burst capacity is measured with")
    p.add_argument("--capacity", type=float, default=None, help="skip the capacity run: this many settled/s")
    p.add_argument("--deadline", type=float, default=3600.0)
    p.add_argument("--lookup-latency-ms", type=float, default=20.0)
    p.add_argument(
        "--post-latency-ms",
        type=float,
        default=200.0,
        help="a clean POST's latency at the provider (default 200): with --max-in-flight, what bounds the fleet",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=10,
        help="OUTBOX_MAX_IN_FLIGHT per worker process (default 10): capacity ~ processes x this / latency",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="60 s of overload after a 1,500-op capacity burst")
    p.add_argument("--shared-cluster", action="store_true", help="OUTBOX_BENCH_PG_URL's cluster, not one of its own")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.capacity_ops = 60.0, 1500

    from contextlib import nullcontext

    from bench.scratch_database import ADMIN_URL
    from workers.sandbox.testing import SandboxProcess

    common = {
        "seed": a.seed,
        "lookup_latency_ms": a.lookup_latency_ms,
        "post_latency_ms": a.post_latency_ms,
        "deadline_s": a.deadline,
        "env": {"OUTBOX_MAX_IN_FLIGHT": str(a.max_in_flight)},
        "verbose": True,
    }
    cluster = nullcontext(ADMIN_URL) if a.shared_cluster else StockCluster()
    with cluster as admin_url, SandboxProcess("--seed", str(a.seed)) as sandbox:
        burst = None
        if a.capacity is None:
            print(f"overload: capacity: {a.capacity_ops} intents at once under the fault mix ...", flush=True)
            # The whole burst in about a second (Steady submits what its rate owes every 50 ms).
            burst = _run(admin_url, sandbox, rate=float(a.capacity_ops), duration_s=1.0, **common)
            measured = capacity_of(burst)
            capacity = measured["per_s"]
            print(
                f"capacity: {capacity:.1f} settled/s (10% to 90% of {burst.scale.intents} settled between "
                f"{measured['t10_s']:.1f} and {measured['t90_s']:.1f} s)"
            )
        else:
            capacity = a.capacity
        if capacity <= 0:
            raise SystemExit("capacity not measured (nothing settled?)")
        rate = a.factor * capacity
        print(f"overload: {rate:.1f}/s ({a.factor:g}x capacity) for {a.duration:g} s ...", flush=True)
        result = _run(
            admin_url,
            sandbox,
            rate=rate,
            duration_s=a.duration,
            drain_within_s=a.duration * a.factor + 300,
            **common,
        )
    judged = goals(capacity, result, a.factor)
    print(result.summary())
    for name, g in judged.items():
        print(f"{'MET    ' if g['met'] else 'NOT MET'} {name}: {g['value']} (goal {g['goal']})")
    rates = windows(result, 0.0, result.duration_s)
    print("settled/s per 10 s window: " + " ".join(f"{r:.0f}" for r in rates))
    for line in result.scale.violations[:30]:
        print(f"VIOLATION {line}")
    out = a.out or ROOT / "bench" / "results" / f"overload-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "goals": judged,
                "capacity_per_s": capacity,
                "capacity_run": None if burst is None else burst.as_json() | {"capacity": capacity_of(burst)},
                "factor": a.factor,
                "offered_per_s": rate,
                "windows_per_s": rates,
                "cluster": "shared" if a.shared_cluster else "own (initdb, stock settings)",
                "run": result.as_json() | {"ticks": result.ticks},
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
