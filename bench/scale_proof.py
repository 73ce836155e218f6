"""``python -m bench.scale_proof``: the command around ``tests/loads/scale_proof.py`` (its docstring says what
is run and what is checked); the tests run the same function at a CI size."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads import scale_proof as runner  # noqa: E402
from tests.loads.scale_proof import (  # noqa: E402
    run_scale_proof,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(runner.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--intents", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="300 intents (the CI-sized run)")
    parser.add_argument(
        "--fencing", action="store_true", help="the sandbox fences and the actions declare provider_fencing"
    )
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument(
        "--stall", type=float, default=0.0, help="share of calls that commit then answer after the read timeout"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON figures (default bench/results/scale-proof-<date>-seed<S>-n<N>.json)",
    )
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.intents = 300

    from bench.scratch_database import ScratchDatabase
    from outbox.ledger.db import make_engine, make_sessionmaker
    from workers.sandbox.testing import SandboxProcess

    with (
        ScratchDatabase() as db,
        tempfile.TemporaryDirectory(prefix="scale-proof-") as tmp,
        SandboxProcess("--seed", str(args.seed)) as sandbox,
    ):
        engine = make_engine(db.url)
        try:
            result = run_scale_proof(
                db_url=db.url,
                sessions=make_sessionmaker(engine),
                sandbox=sandbox,
                tmp=Path(tmp),
                intents=args.intents,
                seed=args.seed,
                workers=args.workers,
                deadline_s=args.deadline_s,
                verbose=not args.quiet,
                fencing=args.fencing,
                stall=args.stall,
            )
        finally:
            engine.dispose()
    print(result.summary(), flush=True)
    print(
        "faults fired: "
        + ", ".join(f"{k}={n}" for k, n in result.faults_fired.items())
        + f"; budget_end_claims={result.budget_end_claims}"
    )
    for why, n in result.handoff_reasons.most_common():
        print(f"handed to a person: {n} x {why}")
    for line in result.violations[:50]:
        print(f"VIOLATION {line}")
    if len(result.violations) > 50:
        print(f"... and {len(result.violations) - 50} more violations")
    out = args.out or (
        ROOT / "bench" / "results" / f"scale-proof-{time.strftime('%Y-%m-%d')}-seed{args.seed}-n{args.intents}"
        f"{'-fencing' if args.fencing else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_json(), indent=2))
    print(f"wrote {out}")
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
