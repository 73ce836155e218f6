"""``agent-outbox approvals list|show|approve|deny``: a person's decision on an intent that waits."""

from __future__ import annotations

import argparse
import json
import logging

from rich.console import Console
from rich.table import Table

from outbox.approvals import decisions as approvals
from outbox.errors import InvalidIntent
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.models import Operation
from outbox.reads.queries import operation_json
from outbox.settings import load_settings
from workers.cli.ledger import open_engine
from workers.wiring.runtime import load_actions_for

log = logging.getLogger("agent_outbox.approvals")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    a = sub.add_parser("approvals", help="intents waiting for a person's approval: list, show, approve, deny")
    s = a.add_subparsers(dest="approvals_command", metavar="SUBCOMMAND")
    p = s.add_parser("list", help="operations awaiting approval, oldest first")
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = s.add_parser("show", help="one operation's approval state and every decision on it")
    p.add_argument("id", metavar="OPERATION_ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    p = s.add_parser("approve", help="approve: the operation becomes due, under the action's current policy")
    p.add_argument("id", metavar="OPERATION_ID")
    p.add_argument("--by", required=True, help="who approves (recorded; not the subject that asked)")
    p.add_argument("--note")
    p.set_defaults(func=cmd_approve)
    p = s.add_parser("deny", help="deny: the operation ends cancelled, nothing sent")
    p.add_argument("id", metavar="OPERATION_ID")
    p.add_argument("--by", required=True)
    p.add_argument("--note", required=True, help="why")
    p.set_defaults(func=cmd_deny)
    a.set_defaults(func=lambda args: a.print_help() or 2)


def cmd_list(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            rows = [approvals.pending_json(op) for op in approvals.pending(session, tenant=args.tenant)]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    table = Table(title=f"{len(rows)} operation(s) awaiting approval")
    for col in ("operation_id", "tenant", "action", "subject", "waiting since", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["operation_id"], r["tenant"], r["action"], r["subject"], r["waiting_since"] or "", r["reason"])
    Console(width=160).print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            op = session.get(Operation, args.id)
            if op is None:
                raise InvalidIntent("OPERATION_ID", f"no operation {args.id}")
            doc = operation_json(op) | {
                "approvals": [approvals.approval_json(a) for a in approvals.history(session, op.id)]
            }
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    print(f"{doc['operation_id']}  {doc['tenant']} / {doc['idempotency_key']}  {doc['action']}: {doc['status']}")
    for a in doc["approvals"]:
        print(
            f"  approval {a['approval_id']}: {a['decision']} by {a['approver']} at {a['decided_at']} "
            f"(policy {a['policy_version']}, expires {a['expires_at']}){': ' + a['note'] if a['note'] else ''}"
        )
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    settings = load_settings()
    actions = load_actions_for(settings)
    engine = open_engine(settings)
    try:
        with make_sessionmaker(engine).begin() as session:
            op = session.get(Operation, args.id)
            if op is None:
                raise InvalidIntent("OPERATION_ID", f"no operation {args.id}")
            spec = actions.action(op.action).approval
            row = approvals.approve(
                session,
                op.id,
                by=args.by,
                note=args.note,
                policy=spec,
            )
            shown = approvals.approval_json(row)
    finally:
        engine.dispose()
    log.info("approved", extra={"operation_id": args.id, "approver": args.by})
    print(f"{args.id}: approved by {args.by} (approval {shown['approval_id']}, policy {shown['policy_version']})")
    return 0


def cmd_deny(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine).begin() as session:
            approvals.deny(session, args.id, by=args.by, note=args.note)
    finally:
        engine.dispose()
    log.info("denied", extra={"operation_id": args.id, "approver": args.by})
    print(f"{args.id}: denied by {args.by}; cancelled, nothing sent")
    return 0
