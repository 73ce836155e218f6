"""``agent-outbox handoffs list|show|take|release|resolve`` and ``agent-outbox evidence backfill``.

The command line acts with the ledger's own credentials: who takes a case is the operating-system
account that ran it (``cli:<account>``), never a flag's text."""

from __future__ import annotations

import argparse
import getpass
import json

from outbox.errors import InvalidIntent
from outbox.evidence.handoffs import handoff_json
from outbox.evidence.sinks import EvidenceSink, backfill
from outbox.ledger.states import PERSON_RESOLUTIONS, Resolution
from outbox.service import handoffs
from outbox.settings import load_settings
from producer.client import action_rules_for
from workers.cli import render
from workers.cli.ledger import ledger


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    h = sub.add_parser("handoffs", help="operations waiting for a person: list, show, resolve")
    hs = h.add_subparsers(dest="handoffs_command", metavar="SUBCOMMAND")
    p = hs.add_parser("list", help="open handoffs, oldest first")
    p.add_argument("--all", action="store_true", help="include resolved ones")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = hs.add_parser("show", help="one handoff with its whole packet")
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    for name, what in (("take", "own the case (your account: cli:<user>)"), ("release", "give the case back")):
        p = hs.add_parser(name, help=what)
        p.add_argument("id", type=int, metavar="ID")
        p.add_argument("--over", action="store_true", help="even when someone else owns it (the history says who)")
        p.set_defaults(func=cmd_take if name == "take" else cmd_release)
    p = hs.add_parser("resolve", help="write a person's decision back")
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--as", dest="resolution", required=True, choices=[r.value for r in PERSON_RESOLUTIONS])
    p.add_argument("--reference", help="the provider's reference (required with --as succeeded)")
    p.add_argument("--note", required=True, help="why: what was checked, and where")
    p.add_argument("--by", required=True, help="who decides")
    p.set_defaults(func=cmd_resolve)
    h.set_defaults(func=lambda a: h.print_help() or 2)

    e = sub.add_parser("evidence", help="evidence records")
    es = e.add_subparsers(dest="evidence_command", metavar="SUBCOMMAND")
    p = es.add_parser("backfill", help="write missing evidence for committed_evidence_degraded operations")
    p.set_defaults(func=cmd_backfill)
    e.set_defaults(func=lambda a: e.print_help() or 2)


COLUMNS: list[render.Column] = [
    ("id", lambda r: r["handoff_id"]),
    ("operation_id", lambda r: r["operation_id"]),
    ("key", lambda r: r["packet"]["operation"]["idempotency_key"]),
    ("action", lambda r: r["packet"]["operation"]["action"]),
    ("opened_at", lambda r: (r["opened_at"] or "")[:19]),
    ("owner", lambda r: r["owner"] or "-"),
    ("next_check_at", lambda r: (r["next_check_at"] or "-")[:19]),
    ("status", lambda r: r["status"] + (f" ({r['resolution']})" if r["resolution"] else "")),
    ("reason", lambda r: r["reason"][:80]),
]


def cmd_list(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        rows = [handoff_json(*row) for row in handoffs.listing(session, None, include_resolved=args.all)]
    return render.listing(rows, as_json=args.json, title="{n} handoff(s)", columns=COLUMNS)


def cmd_show(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        row = handoff_json(*handoffs.with_operation(session, handoffs.get(session, None, args.id)))
    if args.json:
        render.emit_json(row)
        return 0
    console = render.console()
    packet = row["packet"]
    op = packet["operation"]
    console.print(f"[bold]handoff {row['handoff_id']}[/] ({row['status']}) opened {row['opened_at']}")
    console.print(
        f"owner {row['owner'] or '- (nobody has taken it)'}"
        + (f" since {row['taken_at']}" if row["taken_at"] else "")
        + f"; next check {row['next_check_at'] or '- (not re-checked)'}"
        + (f", re-checked until {row['checks_until']}" if row["checks_until"] else "")
    )
    console.print(
        f"1. operation {op['operation_id']}  key {op['idempotency_key']}  tenant {op['tenant']}  "
        f"action {op['action']}  target {op['target']}"
    )
    console.print(
        render.table(
            "2. every attempt",
            ("#", "kind", "started", "token", "sent (digest)", "status", "class", "reference", "error"),
            (
                (
                    a["attempt_number"],
                    a["kind"],
                    (a["started_at"] or "")[:23],
                    a["fencing_token"],
                    (a["request_digest"] or "")[:12],
                    a["status_code"] or "",
                    a["class"] + (" (stale)" if a["stale"] else ""),
                    a["provider_reference"],
                    (a["error"] or "")[:60],
                )
                for a in packet["attempts"]
            ),
        )
    )
    err = packet["last_error"]
    console.print(f"3. last error ({err['class']}): {err['raw']}\n   handed off because: {err['why_handed_off']}")
    console.print(f"4. next step: {packet['next_step']}")
    intent = packet["intent"]
    console.print(
        f"5. intent: args {json.dumps(intent['args'], sort_keys=True)}  subject {intent['subject']}  "
        f"run {intent['run_id']}  tool call {intent['tool_call_id']}"
    )
    if row["resolution"]:
        by = "the provider's evidence" if row["resolved_by_evidence"] else row["resolved_by"]
        console.print(
            f"resolved as {row['resolution']} by {by} at {row['resolved_at']}: {row['note']}"
            + (f" (reference {row['resolved_reference']})" if row["resolved_reference"] else "")
        )
    if row["retried_as"]:
        console.print(f"retried as a new intent: operation {row['retried_as']}")
    return 0


def cli_identity() -> str:
    """Who acts from the command line: the account that ran it (it holds the ledger's credentials)."""
    return f"cli:{getpass.getuser()}"


def cmd_take(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        row = handoffs.take(session, None, args.id, identity=cli_identity(), over=args.over)
        owner = row.handoff.owner
    print(f"handoff {args.id} is now owned by {owner}")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        handoffs.release(session, None, args.id, identity=cli_identity(), over=args.over)
    print(f"handoff {args.id} released: nobody owns it")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    if args.resolution != "succeeded" and args.reference:
        raise InvalidIntent("--reference", "only with --as succeeded")
    settings = load_settings()
    retry = args.resolution == Resolution.RETRY_AS_NEW_INTENT.value
    with ledger(settings) as sessions, sessions.begin() as session:
        status = handoffs.resolve(
            session,
            None,
            args.id,
            resolution=args.resolution,
            by=args.by,
            note=args.note,
            reference=args.reference,
            rules=action_rules_for(settings) if retry else None,
            identity=cli_identity(),
        )
        new = handoffs.with_operation(session, handoffs.get(session, None, args.id)).operation.retried_as
    print(f"handoff {args.id} resolved as {args.resolution} by {args.by}: operation is now {status.value}")
    if retry:
        print(f"retried as a new intent: operation {new}")
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    settings = load_settings()
    sink = EvidenceSink.from_url(settings.evidence_url)
    try:
        with ledger(settings) as sessions, sessions.begin() as session:
            written, failing = backfill(session, sink)
    finally:
        sink.close()
    print(f"evidence written for {written} operation(s); {failing} still failing")
    return 0 if not failing else 1
