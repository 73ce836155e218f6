"""``python -m bench.liveness``: the command around ``tests/loads/liveness.py`` (its docstring says what
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

from tests.loads import liveness as runner  # noqa: E402
from tests.loads.liveness import (  # noqa: E402
    SCENARIOS,
    LivenessResult,
    run_liveness,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(runner.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--intents", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", choices=SCENARIOS, default=None, help="run one scenario only")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/liveness-<date>.json)")
    parser.add_argument(
        "--on-ambiguous",
        choices=("lookup", "replay"),
        default="lookup",
        help="what the actions do after an ambiguous attempt (default lookup: ask the provider)",
    )
    parser.add_argument(
        "--backlog",
        action="store_true",
        help="submit every intent before the pipeline starts and time the pipeline alone (default: submit "
        "while it runs, from this process)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep worker logs under this folder")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)

    from bench.scratch_database import ScratchDatabase
    from outbox.ledger.db import make_engine, make_sessionmaker
    from workers.sandbox.testing import SandboxProcess

    results: dict[str, LivenessResult] = {}
    for name in SCENARIOS:
        if args.only not in (None, name):
            continue
        with (
            ScratchDatabase() as db,
            tempfile.TemporaryDirectory(prefix="liveness-", dir=args.keep) as tmp,
            SandboxProcess("--seed", str(args.seed)) as sandbox,
        ):
            engine = make_engine(db.url)
            try:
                if args.keep:
                    tmp = str(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=args.keep)))
                results[name] = run_liveness(
                    db_url=db.url,
                    sessions=make_sessionmaker(engine),
                    sandbox=sandbox,
                    tmp=Path(tmp),
                    intents=args.intents,
                    seed=args.seed,
                    scenario=name,
                    on_ambiguous=args.on_ambiguous,
                    backlog=args.backlog,
                    verbose=not args.quiet,
                )
            finally:
                engine.dispose()
        print(results[name].summary(), flush=True)
        print(f"dispatch attempts by class: {dict(results[name].attempt_classes)}")
        per_op = results[name].cpu_ms_per_op
        print(
            f"CPU ms per operation ({sum(per_op.values()):.2f} in all): "
            + ", ".join(f"{k} {v:.2f}" for k, v in per_op.items())
        )
        for why, n in results[name].not_sent_why.most_common(5):
            print(f"  not sent x{n}: {why}")
        for line in results[name].scale.violations[:30]:
            print(f"VIOLATION {line}")
    if "clean" in results:
        for name in ("mix", "faults"):
            if name in results:
                ratio = results[name].scale.ops_per_s / results["clean"].scale.ops_per_s
                print(f"{name}: {ratio:.0%} of the clean throughput")
    suffix = ("-replay" if args.on_ambiguous == "replay" else "") + ("-backlog" if args.backlog else "")
    out = args.out or ROOT / "bench" / "results" / f"liveness-{time.strftime('%Y-%m-%d')}-n{args.intents}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: v.as_json() for k, v in results.items()}, indent=2))
    print(f"wrote {out}")
    return 1 if any(r.scale.violations for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
