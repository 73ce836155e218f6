"""Flags every command spells alike: ``--log-level LEVEL`` (``--loglevel``, Celery's spelling, and
``-v``/``-vv`` keep working), ``--version``, and who acts when ``--by`` is left out."""

from __future__ import annotations

import argparse
import getpass
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "agent-outbox-ledger"
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def add_log_level(parser: argparse.ArgumentParser, *, what: str, default: str | None = None) -> None:
    """``--log-level LEVEL`` on ``parser``. On a subcommand it is the same setting as before the
    subcommand (``agent-outbox --log-level debug run`` = ``agent-outbox run --log-level debug``):
    ``default`` None there leaves the attribute alone, so the command reads ``log_level(args, ...)``."""
    parser.add_argument(
        "--log-level",
        "--loglevel",
        dest="log_level",
        type=str.upper,
        choices=LEVELS,
        metavar="LEVEL",
        default=argparse.SUPPRESS if default is None else default,
        help=f"{what}: {', '.join(LEVELS).lower()}",
    )


def log_level(args: argparse.Namespace, default: str) -> str:
    """The level given on the command line (before or after the subcommand), or ``default``."""
    return str(getattr(args, "log_level", None) or default).upper()


def operator_name(given: str | None) -> str:
    """Who acts (``--by``): as given, else this session's user name."""
    if given:
        return given
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment (a container without one)
        return "operator"


def add_version(parser: argparse.ArgumentParser) -> None:
    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a checkout that was never installed
        installed = "unknown"
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {installed}")
