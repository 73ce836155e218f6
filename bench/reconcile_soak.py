"""``python -m bench.reconcile_soak``: the command around ``tests/loads/reconcile_soak.py`` (its docstring says what
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

from tests.loads import reconcile_soak as runner  # noqa: E402
from tests.loads.reconcile_soak import (  # noqa: E402
    RELAY_POLL_S,
    run_soak,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(runner.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=70.0)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ambiguous-scale", type=float, default=1.0)
    parser.add_argument("--lookup-latency-ms", type=float, default=0.0)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument("--reconcilers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--dispatchers", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=0.0)
    parser.add_argument("--relay-poll", type=float, default=RELAY_POLL_S)
    parser.add_argument("--env", action="append", default=[], help="OUTBOX_X=value for every process")
    parser.add_argument("--reconciler-env", action="append", default=[], help="OUTBOX_X=value for the reconcilers")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="keep worker logs under this folder")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)

    from bench.scratch_database import ScratchDatabase
    from outbox.ledger.db import make_engine, make_sessionmaker
    from workers.sandbox.testing import SandboxProcess

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with (
        ScratchDatabase() as db,
        tempfile.TemporaryDirectory(prefix="soak-", dir=args.keep) as tmp,
        SandboxProcess("--seed", str(args.seed)) as sandbox,
    ):
        engine = make_engine(db.url)
        try:
            if args.keep:
                tmp = str(Path(tempfile.mkdtemp(prefix="soak-", dir=args.keep)))
            result = run_soak(
                db_url=db.url,
                sessions=make_sessionmaker(engine),
                sandbox=sandbox,
                tmp=Path(tmp),
                rate=args.rate,
                duration_s=args.duration,
                seed=args.seed,
                ambiguous_scale=args.ambiguous_scale,
                lookup_latency_ms=args.lookup_latency_ms,
                deadline_s=args.deadline,
                reconcilers=args.reconcilers,
                concurrency=args.concurrency,
                dispatchers=args.dispatchers,
                kill_at_s=tuple(args.kill_every * k for k in range(1, int(args.duration // args.kill_every) + 1))
                if args.kill_every
                else (),
                relay_poll_s=args.relay_poll,
                env=dict(e.split("=", 1) for e in args.env),
                reconciler_env=dict(e.split("=", 1) for e in args.reconciler_env),
                verbose=not args.quiet,
            )
        finally:
            engine.dispose()
    print(result.summary(), flush=True)
    print(f"CPU s: {result.cpu_s}")
    for reason, n in result.handoffs.most_common(5):
        print(f"  handoff x{n}: {reason}")
    for line in result.scale.violations[:30]:
        print(f"VIOLATION {line}")
    out = args.out or ROOT / "bench" / "results" / f"reconcile-soak-{time.strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_json(), indent=2))
    print(f"wrote {out}")
    return 1 if result.scale.violations else 0


if __name__ == "__main__":
    sys.exit(main())
