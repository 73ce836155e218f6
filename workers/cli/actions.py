"""``agent-outbox actions check FILE``: the actions file checked offline, every problem at once.

The loader's own checks (workers/provider/actions.py ``read_actions_file``), so what passes here is what
workers load; plus what workers check against the ``OUTBOX_*`` settings when they start. No network,
no database, no secret needed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from outbox.actions.files import ActionsFileError
from workers.cli.render import emit_json

EXIT_PROBLEMS = 1

HELP = """\
Validate an actions file offline (no network, no database, no secrets): every problem is reported
with its dotted path (actions.payments.refund.create.budget.max_attempts: ...), and the exit code is
1 when there is any, 0 with a one-line summary when there is none.

A ${VAR} whose variable is not set here (a secret absent in CI) is a note, not an error, and the
field that holds it is not checked; --strict makes it an error, as it is when workers start. The file
is also checked as workers check it at start-up against this environment's OUTBOX_* settings
(OUTBOX_SOFT_TIME_LIMIT_S, OUTBOX_ARGS_RETENTION_S, ...; their defaults when unset).
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("actions", help="the actions file: `actions check FILE` validates it offline")
    family = p.add_subparsers(dest="actions_command", metavar="COMMAND", required=True)
    c = family.add_parser(
        "check",
        help="validate an actions file offline: every problem with its dotted path; exit 1 if any",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("file", metavar="FILE", help="the actions/targets YAML file")
    c.add_argument("--json", action="store_true", help="one JSON object: ok, problems, notes, counts")
    c.add_argument("--strict", action="store_true", help="a ${VAR} whose variable is not set is an error")
    c.set_defaults(func=cmd_check)


def check_file(path: str, *, strict: bool) -> dict[str, Any]:
    """The file's problems and notes as ``--json`` prints them."""
    from workers.provider.actions import read_actions_file

    notes: list[dict[str, str]] = []
    try:
        reading = read_actions_file(path, strict=strict)
    except ActionsFileError as exc:  # unreadable, or not YAML
        problems, counts = list(exc.problems), (0, 0)
    else:
        problems, counts = list(reading.problems), reading.declared
        notes = [
            {"path": where, "variable": name, "message": f"${{{name}}} is not set here; this value was not checked"}
            for where, name in ([] if strict else reading.unset)
        ]
        if reading.config is not None:
            from outbox.settings import load_settings
            from workers.wiring.builders import start_up_problems

            refused = start_up_problems(load_settings(), reading.config)
            problems += [("", f"workers would refuse to start: {why}") for why in refused]
    return {
        "file": path,
        "ok": not problems,
        "strict": strict,
        "actions": counts[0],
        "targets": counts[1],
        "problems": [{"path": where, "message": message} for where, message in problems],
        "notes": notes,
    }


def cmd_check(args: argparse.Namespace) -> int:
    doc = check_file(args.file, strict=args.strict)
    if args.json:
        emit_json(doc)
        return 0 if doc["ok"] else EXIT_PROBLEMS
    for note in doc["notes"]:
        print(f"note: {note['path']}: {note['message']}", file=sys.stderr)
    for problem in doc["problems"]:
        print(f"{problem['path']}: {problem['message']}" if problem["path"] else problem["message"])
    counts = f"{_many(doc['actions'], 'action')}, {_many(doc['targets'], 'target')}"
    if doc["ok"]:
        print(f"{args.file}: ok ({counts})")
        return 0
    print(f"{args.file}: {len(doc['problems'])} problem(s) ({counts})", file=sys.stderr)
    return EXIT_PROBLEMS


def _many(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
