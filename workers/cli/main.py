"""The ``agent-outbox`` command line: one parser, each subcommand in the module of its concept.

Exit codes (stable, scripts rely on them): 0 done; 1 failed at run time (database unreachable, ...);
2 invalid input (the message names the field or variable); 3 idempotency conflict.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from outbox.errors import ConfigError, IdempotencyConflict, InvalidIntent, NotFound, OutboxError, RunConflict
from workers.cli.flags import add_log_level, add_version, log_level

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_CONFLICT = 0, 1, 2, 3

# Each entry registers one family of subcommands; optional ones are skipped when their package
# is absent so that the ledger commands never depend on them.
REGISTRARS: tuple[str, ...] = (
    "workers.cli.operations:register",
    "workers.cli.pipeline:register",
    "workers.cli.handoffs:register",
    "workers.cli.report:register",
    "workers.cli.demo:register",
    "workers.cli.breakers:register",
    "workers.cli.metrics:register",
    "workers.cli.retention:register",
    "workers.cli.api:register",
    "workers.cli.approvals:register",
    "workers.cli.runs:register",
    "workers.cli.mcp:register",
    "workers.cli.actions:register",
    "workers.sandbox.cli:register",
)


def _load(spec: str) -> Callable[[argparse._SubParsersAction], None] | None:  # type: ignore[type-arg]
    module_name, attr = spec.split(":")
    try:
        module = __import__(module_name, fromlist=[attr])
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise
    return getattr(module, attr)  # type: ignore[no-any-return]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-outbox",
        description="Execute AI agent side effects at most once, and say so honestly when unsure.",
    )
    add_version(parser)
    add_log_level(parser, what="this command's log output (default warning)", default=None)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for spec in REGISTRARS:
        register = _load(spec)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = log_level(args, logging.getLevelName(logging.WARNING - 10 * min(args.verbose, 2)))
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INVALID
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"agent-outbox: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except InvalidIntent as exc:
        print(f"agent-outbox: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except (IdempotencyConflict, RunConflict) as exc:
        print(f"agent-outbox: idempotency conflict: {exc}", file=sys.stderr)
        return EXIT_CONFLICT
    except NotFound as exc:
        print(f"agent-outbox: not found: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except OutboxError as exc:
        print(f"agent-outbox: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
