"""``agent-outbox purge``: remove the arguments and provider responses of old terminal operations."""

from __future__ import annotations

import argparse
import json
import sys

from outbox.privacy.retention import PurgeResult, check_retention, purge
from outbox.settings import load_settings
from workers.cli.ledger import ledger
from workers.wiring.builders import load_actions_for


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "purge",
        help="remove arguments and provider responses of terminal operations older than OUTBOX_ARGS_RETENTION_S",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would be purged; change nothing")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (progress goes to stderr)")
    p.set_defaults(func=cmd_purge)


def cmd_purge(args: argparse.Namespace) -> int:
    settings = load_settings()
    # The provider answers for a key until it forgets it: until then the arguments must stay.
    actions = load_actions_for(settings)
    check_retention(settings.args_retention_s, actions.key_retentions())
    verb = "would purge" if args.dry_run else "purged"

    def progress(r: PurgeResult) -> None:
        print(f"... {verb} {r.operations} operation(s) so far", file=sys.stderr, flush=True)

    with ledger(settings) as sessions:
        result = purge(sessions, older_than_s=settings.args_retention_s, dry_run=args.dry_run, progress=progress)
    if args.json:
        print(json.dumps(result.as_dict(dry_run=args.dry_run, older_than_s=settings.args_retention_s), sort_keys=True))
    else:
        print(
            f"{verb} the arguments and provider responses of {result.operations} terminal operation(s) "
            f"finished more than {settings.args_retention_s:g}s ago ({result.handoffs} handoff packet(s), "
            f"{result.runs} finished run(s)); "
            "states, digests, references, attempts and history are kept"
        )
    return 0
