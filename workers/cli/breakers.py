"""Breaker commands: ``breaker status`` and ``breaker reset TARGET`` (workers/service/breakers.py,
which the HTTP API and the console call too).

Both read OUTBOX_ACTIONS_FILE (the targets) and OUTBOX_REDIS_URL (the shared breaker state), with
the namespace the workers use (OUTBOX_BROKER_KEY_PREFIX or "default"). Without OUTBOX_REDIS_URL
every worker keeps its breakers in its own memory: this process cannot see them, so ``status`` says
so instead of showing a made-up "closed", and ``reset`` refuses (it could not reach them).
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import Any

from breaker.errors import BreakerStorageUnavailable
from outbox.settings import load_settings
from workers.cli import render
from workers.cli.ledger import ledger
from workers.service import breakers
from workers.service.breakers import LOCAL_NOTE

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("breaker", help="read and reset the circuit breakers of the targets")
    b_sub = p.add_subparsers(dest="breaker_command", metavar="SUBCOMMAND")
    s = b_sub.add_parser("status", help="every target of the actions file: state, failures, opened at, reopens at")
    s.add_argument("--json", action="store_true", help="one JSON document")
    s.set_defaults(func=cmd_status)
    r = b_sub.add_parser("reset", help="close a target's breaker now, in every worker")
    r.add_argument("target", metavar="TARGET")
    r.add_argument("--by", help="who resets (default: the current user)")
    r.set_defaults(func=cmd_reset)
    p.set_defaults(func=lambda args: (p.print_help(), EXIT_INVALID)[1])


COLUMNS: list[render.Column] = [
    ("TARGET", lambda r: r["target"]),
    ("STATE", lambda r: r["state"]),
    ("FAILURES", lambda r: f"{r['failures']}/{r['fail_max']}"),
    ("OPENED AT", lambda r: r["opened_at"] or "-"),
    ("REOPENS AT", lambda r: r["reopens_at"] or "-"),
    ("LIMITS", lambda r: r["limits"] or "-"),
    ("NOW", lambda r: "-" if r["admitted_last_s"] is None else f"{r['admitted_last_s']}/s, {r['in_flight']} in flight"),
]


def cmd_status(args: argparse.Namespace) -> int:
    try:
        board = breakers.board(load_settings())
    except BreakerStorageUnavailable as exc:
        print(f"agent-outbox: {exc}; check OUTBOX_REDIS_URL", file=sys.stderr)
        return EXIT_FAILED
    rows = [row.as_json() for row in board.breakers]
    doc: dict[str, Any] = {"namespace": board.namespace, "shared": board.shared, "breakers": rows}
    doc |= {"storage": "redis"} if board.shared else {"storage": "process-local", "note": LOCAL_NOTE}
    if args.json:
        render.emit_json(doc)
        return EXIT_OK
    if not board.shared:
        print(LOCAL_NOTE)
        print("targets: " + ", ".join(r["target"] for r in rows))
        return EXIT_OK
    return render.listing(rows, as_json=False, title="{n} breaker(s)", columns=COLUMNS)


def cmd_reset(args: argparse.Namespace) -> int:
    settings = load_settings()
    by = args.by or os.environ.get("USER") or getpass.getuser()
    try:
        done = breakers.reset_and_wake(settings, lambda: ledger(settings), args.target, by=by)
    except breakers.TargetNotFound as exc:
        print(f"agent-outbox: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except breakers.LocalBreakers as exc:
        print(f"agent-outbox: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BreakerStorageUnavailable as exc:
        print(f"agent-outbox: breaker not reset: {exc}; check OUTBOX_REDIS_URL", file=sys.stderr)
        return EXIT_FAILED
    except breakers.NotWoken as exc:
        print(f"breaker {args.target} closed by {by}", file=sys.stdout)
        print(f"agent-outbox: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"breaker {done.target} closed by {done.by} at {done.at.isoformat(timespec='seconds')}")
    print(f"{done.woken} parked operation(s) due now")
    return EXIT_OK
