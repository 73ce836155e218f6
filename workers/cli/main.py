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

# Each entry registers one family of subcommands, named beside it so that a command loads only its
# own module (every module, with alembic, Celery and the report behind some, cost ~0.45 s at every
# start); optional ones are skipped when their package is absent so that the ledger commands never
# depend on them. tests/unit/test_cli_flags.py checks the names against what each module registers.
REGISTRARS: dict[str, tuple[str, ...]] = {
    "workers.cli.operations:register": ("migrate", "ops", "submit"),
    "workers.cli.pipeline:register": ("relay", "run", "sweep", "worker"),
    "workers.cli.handoffs:register": ("evidence", "handoffs"),
    "workers.cli.report:register": ("report",),
    "workers.cli.demo:register": ("demo",),
    "workers.cli.breakers:register": ("breaker",),
    "workers.cli.metrics:register": ("metrics",),
    "workers.cli.retention:register": ("purge",),
    "workers.cli.api:register": ("keys", "serve"),
    "workers.cli.approvals:register": ("approvals",),
    "workers.cli.subjects:register": ("subjects",),
    "workers.cli.runs:register": ("runs",),
    "workers.cli.mcp:register": ("mcp",),
    "workers.cli.actions:register": ("actions",),
    "workers.sandbox.cli:register": ("sandbox",),
    "workers.cli.health:register": ("health",),
    "workers.cli.probe:register": ("probe",),
}
# Top-level options that take a value: the token after them is not the command.
_VALUED_OPTIONS = frozenset({"--log-level", "--loglevel"})
VERSION_ONLY = "--version"  # answered before any subcommand is parsed: no module needed


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first positional token), ``VERSION_ONLY`` for --version,
    or None (help, none)."""
    if "--version" in argv and not {"-h", "--help"} & set(argv):
        return VERSION_ONLY
    tokens = iter(argv)
    for token in tokens:
        if token in _VALUED_OPTIONS:
            next(tokens, None)
        elif not token.startswith("-"):
            return token
    return None


def _load(spec: str) -> Callable[[argparse._SubParsersAction], None] | None:  # type: ignore[type-arg]
    module_name, attr = spec.split(":")
    try:
        module = __import__(module_name, fromlist=[attr])
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise
    return getattr(module, attr)  # type: ignore[no-any-return]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command``, only the module that registers it is loaded (unknown: all,
    so that argparse lists every choice)."""
    parser = argparse.ArgumentParser(
        prog="agent-outbox",
        description="Execute AI agent side effects at most once, and say so honestly when unsure.",
    )
    add_version(parser)
    add_log_level(parser, what="this command's log output (default warning)", default=None)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command == VERSION_ONLY:
        specs: list[str] = []
    else:
        specs = [spec for spec, names in REGISTRARS.items() if command in names] or list(REGISTRARS)
    for spec in specs:
        register = _load(spec)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_in(argv))
    args = parser.parse_args(argv)
    level = log_level(args, logging.getLevelName(logging.WARNING - 10 * min(args.verbose, 2)))
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INVALID
    try:
        from workers.ground import logs  # outbox.settings (pydantic): not for --version or --help

        logs.configure(level)
        from workers.ground import tracing

        tracing.configure()
        return int(args.func(args) or 0)
    except ConfigError as exc:
        _say(f"agent-outbox: {exc}")
        return EXIT_INVALID
    except InvalidIntent as exc:
        _say(f"agent-outbox: invalid input: {exc}")
        return EXIT_INVALID
    except (IdempotencyConflict, RunConflict) as exc:
        _say(f"agent-outbox: idempotency conflict: {exc}")
        return EXIT_CONFLICT
    except NotFound as exc:
        _say(f"agent-outbox: not found: {exc}")
        return EXIT_INVALID
    except OutboxError as exc:
        _say(f"agent-outbox: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _say(text: str) -> None:
    """An error that ends the command, on stderr: a JSON record under OUTBOX_LOG_FORMAT=json (a
    long-running command's output is a log stream), the text itself otherwise."""
    from workers.ground import logs

    logs.say(text, level=logging.ERROR, logger="agent_outbox")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
