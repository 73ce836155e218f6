"""``make bench``: every benchmark once, quickly.

1. the ledger (``bench.ledger_bench --quick``: submit, claim+finalize beside the bare loop, commits);
2. the sandbox's plain path (``bench.sandbox_rps`` for 5 s), driven by wrk when it is installed,
   else by its aiohttp client fallback (``sandbox_rps`` picks that itself);
3. the pipeline end to end (``bench.pipeline_bench --quick``: 300 operations submit -> succeeded
   with 2 prefork workers, beside bare Celery no-op tasks on the same broker);
4. the relay's commit-to-publish latency (``bench.relay_latency --quick``: LISTEN/NOTIFY and
   polling at 0.05 s, 60 samples each);
5. the scale-out proof (``bench.scale_proof --quick``: 300 intents, 4 workers + reconciler, seeded
   faults, a private Redis restart and a worker SIGKILL mid-run; exits 1 on any invariant violation);
6. claim latency beside a big table (``bench.claim_latency --quick``: 10k and 100k finished rows,
   200 claims each);
7. submit in the caller's transaction per driver (``bench.submit_drivers --quick``: psycopg 3,
   psycopg2, asyncpg, psycopg 3 async; 300 intents each).

``python -m bench.run --full`` (``make bench-full``, about 30 minutes on 2 cores) runs instead
what issue 21's and 35's figures come from, in one go: the pipeline beside bare Celery and the naive
pipeline (3 runs, medians; worker RSS/USS; one and two worker nodes), the same under a CPU quota of
0.8 CPU, and presubmitted with and without it (a slower CPU, emulated), the naive pipeline under the
fault mix (its duplicates and lies), liveness at 10,000 intents (clean, the fault mix, the mix plus
process faults), claim latency at 10k and 1M finished rows, the HTTP API beside
``producer.submit`` (one and two server processes), the 10-minute soak (``bench.soak``, on a
PostgreSQL cluster of its own with stock settings), overload at twice the fleet's capacity under
the fault mix for 5 minutes (``bench.overload``), PostgreSQL's statements per operation
(``bench.pg_statements``), one fleet draining two ledgers, each in a cluster of its own, with
the CPU per operation of each database (``bench.two_ledgers``), another tenant's latency behind one
tenant's backlog at a 50/s target (``bench.fairness --rate-limit 50``) and a declared limit as the
provider sees it (``bench.rate_limits``).

Exits non-zero if any benchmark does. Figures: bench/README.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BENCHMARKS = [
    [sys.executable, "-m", "bench.ledger_bench", "--quick"],
    [
        sys.executable,
        "-m",
        "bench.sandbox_rps",
        "--seconds",
        "5",
        "--client",
        "wrk" if shutil.which("wrk") else "aiohttp",
    ],
    [sys.executable, "-m", "bench.pipeline_bench", "--quick"],
    [sys.executable, "-m", "bench.relay_latency", "--quick"],
    [sys.executable, "-m", "bench.scale_proof", "--quick", "-q"],
    [sys.executable, "-m", "bench.claim_latency", "--quick"],
    [sys.executable, "-m", "bench.submit_drivers", "--quick"],
]

# The pipeline in the shape of the quota runs below: 2 prefork workers, no naive pipeline.
QUOTA_PIPELINE = [sys.executable, "-m", "bench.pipeline_bench", "--workers", "2", "--pools", "prefork", "--no-naive"]

FULL = [
    [
        sys.executable,
        "-m",
        "bench.pipeline_bench",
        "--ops",
        "2000",
        "--workers",
        "2",
        "--pools",
        "prefork",
        "--repeats",
        "3",
        "--nodes",
        "1,2",
    ],
    # The ratio on a slower CPU: the same pipeline under a cgroup quota of 0.8 CPU (half bare Celery's
    # rate on the AMD EPYC machines, two thirds on an Intel Xeon one), and the pipeline alone
    # (presubmitted) with and without it (bench/cpu_quota.py).
    [*QUOTA_PIPELINE, "--ops", "2000", "--repeats", "2", "--cpu-quota", "0.8"],
    [*QUOTA_PIPELINE, "--presubmit", "--ops", "3000", "--repeats", "1"],
    [*QUOTA_PIPELINE, "--presubmit", "--ops", "3000", "--repeats", "1", "--cpu-quota", "0.8"],
    [sys.executable, "-m", "bench.naive_pipeline", "--faults", "--ops", "1000"],
    [sys.executable, "-m", "bench.liveness", "-q"],
    [sys.executable, "-m", "bench.claim_latency"],
    [sys.executable, "-m", "bench.api_bench"],
    [sys.executable, "-m", "bench.soak"],
    [sys.executable, "-m", "bench.overload"],
    [sys.executable, "-m", "bench.pg_statements"],
    [sys.executable, "-m", "bench.two_ledgers"],
    # Fair behind a limit: one tenant's 1,500 behind a 50/s target, another's one a second; and the
    # provider's view of a declared limit (never more than the rate plus its burst in a window).
    [sys.executable, "-m", "bench.fairness", "--burst", "1500", "--trickle-s", "20", "--rate-limit", "50"],
    [sys.executable, "-m", "bench.rate_limits"],
    # The unit costs the end-to-end model is made of (bench/README.md, "where the rest of the gap is").
    [sys.executable, "-m", "bench.unit_costs"],
]


def main(argv: list[str] | None = None) -> int:
    full = "--full" in (sys.argv[1:] if argv is None else argv)
    failed = []
    for cmd in FULL if full else BENCHMARKS:
        print(f"\n$ {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            failed.append(cmd[2])
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
