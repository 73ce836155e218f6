"""``agent-outbox health``: a liveness / readiness probe for the processes that serve no HTTP
(relay, dispatch workers, reconciler, beat), for Kubernetes exec probes and compose healthchecks.

    agent-outbox health --heartbeat            # OUTBOX_HEARTBEAT_FILE touched within --max-age
    agent-outbox health --heartbeat /tmp/hb --max-age 60
    agent-outbox health --ledger               # the ledger answers (readiness)

One line per check on stdout; exit 0 when every check passes, 1 when one fails, 2 when none was
asked for. Light on purpose: it imports neither Celery nor the ledger's models unless asked.
"""

from __future__ import annotations

import argparse
import os

from workers.cli.main import EXIT_INVALID
from workers.ground.heartbeat import ENV, age_s

DEFAULT_MAX_AGE_S = 60.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "health",
        help="probe: is this process's heartbeat fresh, does the ledger answer (exit 0 yes, 1 no)",
        description="Liveness and readiness for the relay, workers and beat (Kubernetes exec probes, "
        "compose healthchecks): they touch OUTBOX_HEARTBEAT_FILE from their own loop.",
    )
    p.add_argument(
        "--heartbeat",
        nargs="?",
        const="",
        metavar="FILE",
        help=f"check the heartbeat file (default ${ENV}) was touched within --max-age",
    )
    p.add_argument(
        "--max-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        metavar="SECONDS",
        help=f"oldest heartbeat still alive (default {DEFAULT_MAX_AGE_S:g})",
    )
    p.add_argument("--ledger", action="store_true", help="check the ledger answers (OUTBOX_DATABASE_URL)")
    p.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    if args.heartbeat is None and not args.ledger:
        print("health: nothing to check: give --heartbeat [FILE] and/or --ledger")
        return EXIT_INVALID
    if args.max_age <= 0:
        print("health: --max-age must be > 0 seconds")
        return EXIT_INVALID
    ok = True
    if args.heartbeat is not None:
        path = args.heartbeat or os.environ.get(ENV, "")
        if not path:
            print(f"health: --heartbeat without FILE needs {ENV} (the file the process touches)")
            return EXIT_INVALID
        age = age_s(path)
        if age is None:
            ok = False
            print(f"heartbeat: FAIL: {path} does not exist (the process has not started its loop, or has no {ENV})")
        elif age > args.max_age:
            ok = False
            print(f"heartbeat: FAIL: {path} last touched {age:.0f} s ago (max {args.max_age:g} s): its loop is stuck")
        else:
            print(f"heartbeat: ok ({age:.1f} s old, max {args.max_age:g} s)")
    if args.ledger:
        reason = _ledger_problem()
        ok = ok and reason is None
        print("ledger: ok" if reason is None else f"ledger: FAIL: {reason}")
    return 0 if ok else 1


def _ledger_problem() -> str | None:
    from outbox.ledger.db import make_engine, unreachable
    from outbox.settings import load_settings

    engine = make_engine(load_settings().resolved_database_url)
    try:
        exc = unreachable(engine)
    finally:
        engine.dispose()
    if exc is None:
        return None
    said = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return f"unreachable ({type(exc).__name__}: {said})"
