"""Command line: `agent-outbox sandbox ...` and `python -m workers.sandbox ...` share this parser."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from workers.sandbox import ServerNotInstalled
from workers.sandbox.config import SandboxConfig, SettingError
from workers.sandbox.faults import RuleError
from workers.sandbox.state import SandboxState


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8787, help="0 picks a free port (printed at start)")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='fault rule, repeatable, e.g. \'{"mode": "commit_then_drop", "count": 1}\'',
    )
    parser.add_argument(
        "--no-idempotency", action="store_true", help="ignore Idempotency-Key: repeated keys create repeated objects"
    )
    parser.add_argument(
        "--no-compare-params",
        action="store_true",
        help="a known key with other parameters replays the first answer instead of idempotency_error",
    )
    parser.add_argument(
        "--params-mismatch-status", type=int, default=409, help="idempotency_error's status: 409, or 400 as Stripe"
    )
    parser.add_argument("--retention-s", type=float, default=86400.0, help="idempotency key retention")
    parser.add_argument("--index-lag-s", type=float, default=0.0, help="delay before lookups see a new object")
    parser.add_argument(
        "--strict-fencing",
        action="store_true",
        help="refuse an X-Fencing-Token lower than the highest seen for the key",
    )
    parser.add_argument(
        "--processing-s", type=float, default=0.0, help="objects read as 'pending' for this long after creation"
    )
    parser.add_argument(
        "--processing-status", type=int, default=200, help="status of a creation while processing: 200, 201 or 202"
    )
    parser.add_argument(
        "--processing-fails", default="", help="glob of idempotency keys whose objects end 'failed' after processing"
    )
    parser.add_argument("--over-limit", default="10000.00", help="refunds above this amount get 402")
    parser.add_argument("--seed", type=int, default=None, help="default seed for probabilistic fault rules")
    parser.add_argument("--access-log", action="store_true", help="log every request (slower)")
    # As agent-outbox spells it everywhere (--loglevel too); unset: WARNING, or what was given
    # before the subcommand (agent-outbox --log-level debug sandbox).
    parser.add_argument(
        "--log-level", "--loglevel", dest="log_level", metavar="LEVEL", default=argparse.SUPPRESS, type=str.upper
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("sandbox", help="run the sandbox provider (a fake business API)")
    add_options(parser)
    parser.set_defaults(func=run)


def build_state(args: argparse.Namespace) -> SandboxState:
    config = SandboxConfig()
    # Through update() so command-line values get the same validation as POST /admin/config.
    config.update(
        {
            "idempotency": not args.no_idempotency,
            "compare_params": not args.no_compare_params,
            "params_mismatch_status": args.params_mismatch_status,
            "retention_s": args.retention_s,
            "index_lag_s": args.index_lag_s,
            "strict_fencing": args.strict_fencing,
            "processing_s": args.processing_s,
            "processing_status": args.processing_status,
            "processing_fails": args.processing_fails,
            "over_limit_amount": args.over_limit,
        }
    )
    state = SandboxState.create(config, seed=args.seed)
    for text in args.fault:
        state.faults.add(json.loads(text))
    return state


def run(args: argparse.Namespace) -> int:
    try:
        from workers.sandbox.server import serve_forever  # aiohttp is imported only when serving
    except ServerNotInstalled as exc:
        print(f"sandbox: {exc}", file=sys.stderr)
        return 2

    from workers.sandbox import logs

    level = getattr(args, "log_level", None) or "WARNING"
    try:
        logs.configure(level)
        state = build_state(args)
    except (ValueError, RuleError, SettingError) as exc:
        print(f"sandbox: bad option: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_forever(state, args.host, args.port, args.access_log))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.sandbox", description="Run the sandbox provider.")
    add_options(parser)
    return run(parser.parse_args(argv))
