"""``agent-outbox probe ACTION``: check an action's declarations against the provider's test mode
(workers/provider/probe.py). Exit 0: every declaration holds; 1: one is broken (each names the
setting to change), or the provider did not answer the create; 2: usage or configuration error (the
target is not declared ``test_mode: true``, arguments the provider refuses)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from outbox.errors import ConfigError
from workers.cli import render

EXIT_OK, EXIT_BROKEN, EXIT_INVALID = 0, 1, 2


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "probe",
        help="check an action's provider declarations (idempotency, lookup, fencing) against its test mode",
        description="Runs only against a target declared `test_mode: true` in the actions file; makes real "
        "requests (keys prefixed probe-) and lists the effects it made.",
    )
    p.add_argument("action", metavar="ACTION")
    p.add_argument("--actions", metavar="FILE", help="the actions file (default: OUTBOX_ACTIONS_FILE)")
    p.add_argument("--args", metavar="JSON", default="{}", help="the arguments of the probe's create, as JSON")
    p.add_argument("--tenant", default="", help="whose credentials to use (targets.<name>.tenants)")
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=cmd_probe)


def _args(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--args is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError("--args must be a JSON object of the action's arguments")
    return value


def cmd_probe(args: argparse.Namespace) -> int:
    from workers.provider.actions import ENV_VAR, load_actions
    from workers.provider.probe import run_probe

    path = args.actions or os.environ.get(ENV_VAR)
    if not path:
        raise ConfigError(f"name the actions file: --actions FILE or {ENV_VAR}")
    report = run_probe(load_actions(path), args.action, _args(args.args), tenant=args.tenant)
    if args.json:
        render.emit_json(report.as_json())
    else:
        out = render.console()
        rows = ([c.name, c.declared, c.observed, c.verdict, c.fix or ""] for c in report.checks)
        title = f"probe of {report.action} at {report.target} (test mode)"
        out.print(render.table(title, ["CHECK", "DECLARED", "OBSERVED", "VERDICT", "SETTING TO CHANGE"], rows))
        out.print(
            f"effects made: {len(report.effects)} ({', '.join(report.effects) or 'none'}); keys: {', '.join(report.keys)}"
        )
        out.print("all declarations hold" if report.ok else "BROKEN: change the settings named above")
    return EXIT_OK if report.ok else EXIT_BROKEN
