"""``agent-outbox handoffs list|show|resolve`` and ``agent-outbox evidence backfill``."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from outbox.errors import InvalidIntent
from outbox.evidence import handoffs
from outbox.evidence.sinks import EvidenceSink, backfill
from outbox.ledger.db import make_sessionmaker
from outbox.settings import load_settings
from workers.cli.ledger import open_engine


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
    p = hs.add_parser("resolve", help="write a person's decision back")
    p.add_argument("id", type=int, metavar="ID")
    p.add_argument("--as", dest="resolution", required=True, choices=handoffs.RESOLUTIONS)
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


def cmd_list(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            rows = [
                handoffs.handoff_json(h) for h in handoffs.list_handoffs(session, status=None if args.all else "open")
            ]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    table = Table(title=f"{len(rows)} handoff(s)")
    for col in ("id", "operation_id", "key", "action", "opened_at", "status", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        op = r["packet"]["operation"]
        table.add_row(
            str(r["handoff_id"]),
            r["operation_id"],
            op["idempotency_key"],
            op["action"],
            (r["opened_at"] or "")[:19],
            r["status"] + (f" ({r['resolution']})" if r["resolution"] else ""),
            r["reason"][:80],
        )
    Console(width=160).print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            row = handoffs.handoff_json(handoffs.get_handoff(session, args.id))
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(row, indent=2, sort_keys=True))
        return 0
    console = Console(width=160, highlight=False)
    packet = row["packet"]
    op = packet["operation"]
    console.print(f"[bold]handoff {row['handoff_id']}[/] ({row['status']}) opened {row['opened_at']}")
    console.print(
        f"1. operation {op['operation_id']}  key {op['idempotency_key']}  tenant {op['tenant']}  "
        f"action {op['action']}  target {op['target']}"
    )
    table = Table(title="2. every attempt")
    for col in ("#", "kind", "started", "token", "sent (digest)", "status", "class", "reference", "error"):
        table.add_column(col, overflow="fold")
    for a in packet["attempts"]:
        table.add_row(
            str(a["attempt_number"]),
            a["kind"],
            (a["started_at"] or "")[:23],
            str(a["fencing_token"]),
            (a["request_digest"] or "")[:12],
            str(a["status_code"] or ""),
            a["class"] + (" (stale)" if a["stale"] else ""),
            a["provider_reference"] or "",
            (a["error"] or "")[:60],
        )
    console.print(table)
    err = packet["last_error"]
    console.print(f"3. last error ({err['class']}): {err['raw']}\n   handed off because: {err['why_handed_off']}")
    console.print(f"4. next step: {packet['next_step']}")
    intent = packet["intent"]
    console.print(
        f"5. intent: args {json.dumps(intent['args'], sort_keys=True)}  subject {intent['subject']}  "
        f"run {intent['run_id']}  tool call {intent['tool_call_id']}"
    )
    if row["resolution"]:
        console.print(
            f"resolved as {row['resolution']} by {row['resolved_by']} at {row['resolved_at']}: {row['note']}"
            + (f" (reference {row['resolved_reference']})" if row["resolved_reference"] else "")
        )
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    if args.resolution != "succeeded" and args.reference:
        raise InvalidIntent("--reference", "only with --as succeeded")
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine).begin() as session:
            status = handoffs.resolve(
                session, args.id, resolution=args.resolution, by=args.by, note=args.note, reference=args.reference
            )
    finally:
        engine.dispose()
    print(f"handoff {args.id} resolved as {args.resolution} by {args.by}: operation is now {status.value}")
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    settings = load_settings()
    engine = open_engine(settings)
    sink = EvidenceSink.from_url(settings.evidence_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            written, failing = backfill(session, sink)
    finally:
        sink.close()
        engine.dispose()
    print(f"evidence written for {written} operation(s); {failing} still failing")
    return 0 if not failing else 1
