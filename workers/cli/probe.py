"""``agent-outbox probe ACTION``: the provider contract checked against a provider's test mode
(workers/provider/probe.py). A table, or ``--json``; exit 0 when every declaration held, 1 when one
is broken (each says which actions-file setting to change), 2 when the probe could not run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from workers.cli.main import EXIT_INVALID
from workers.cli.render import emit_json

if TYPE_CHECKING:
    from workers.provider.probe import ProbeReport

HELP = """\
Send real requests to the action's target, which must be the provider's test mode (targets.NAME.
test_mode: true, or --allow-live), and check what every guarantee rests on: the same key replays
the same result; other arguments under a used key are refused; the lookup finds the effect within
lookup.settle_s (and how long it took); "not found" for a key never used (if declared
authoritative); an older fencing token refused after a newer one (if provider_fencing). Probe keys
are probe-<random>; the probe makes one effect, more only where the provider breaks a declaration.
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "probe",
        help="check a provider against the action's declarations (idempotency, lookup, not-found, fencing)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", metavar="ACTION", help="the action to probe, e.g. payments.refund.create")
    p.add_argument("--args", required=True, help="a JSON object of arguments the provider accepts")
    p.add_argument("--actions", metavar="FILE", help="the actions file (default: OUTBOX_ACTIONS_FILE)")
    p.add_argument("--tenant", default="probe", help="the tenant whose credentials the calls carry (default probe)")
    p.add_argument("--allow-live", action="store_true", help="probe a target not declared test_mode (real effects)")
    p.add_argument("--json", action="store_true", help="one JSON object: action, target, probe_key, ok, checks")
    p.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    from workers.provider.actions import load_actions, load_actions_from_env
    from workers.provider.probe import Probe, ProbeRefused

    try:
        call_args = json.loads(args.args)
    except ValueError as exc:
        print(f"agent-outbox probe: --args is not JSON ({exc})", file=sys.stderr)
        return EXIT_INVALID
    if not isinstance(call_args, dict):
        print("agent-outbox probe: --args must be a JSON object of the action's arguments", file=sys.stderr)
        return EXIT_INVALID
    actions = load_actions(args.actions) if args.actions else load_actions_from_env()
    try:
        probe = Probe(actions, args.action, call_args, tenant=args.tenant, allow_live=args.allow_live)
        report = probe.run()
    except ProbeRefused as exc:
        print(f"agent-outbox probe: {exc}", file=sys.stderr)
        return EXIT_INVALID
    finally:
        if "probe" in locals():
            probe.connector.close()
    if args.json:
        emit_json(report.as_json())
    else:
        _table(report)
    return 0 if report.ok else 1


def _table(report: ProbeReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"probe of {report.action} (target {report.target}, key {report.probe_key})")
    for column in ("check", "declared", "observed", "verdict", "setting to change"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        verdict = {True: "ok", False: "BROKEN", None: "not checked"}[c.ok]
        table.add_row(c.name, c.declared, c.observed, verdict, c.fix)
    Console(width=160).print(table)
    print("every declaration held" if report.ok else "a declaration is broken: see 'setting to change'")
