"""``agent-outbox approvals list|show|approve|deny``: a person's decision on an intent that waits."""

from __future__ import annotations

import argparse

from outbox.approvals.decisions import pending_json
from outbox.service import approvals
from outbox.settings import load_settings
from workers.cli import render
from workers.cli.ledger import ledger
from workers.service.policies import approval_policies


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


COLUMNS: list[render.Column] = [
    ("operation_id", lambda r: r["operation_id"]),
    ("tenant", lambda r: r["tenant"]),
    ("action", lambda r: r["action"]),
    ("subject", lambda r: r["subject"]),
    ("waiting since", lambda r: r["waiting_since"]),
    ("reason", lambda r: r["reason"]),
]


def cmd_list(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        rows = [pending_json(op) for op in approvals.pending(session, args.tenant)]
    return render.listing(rows, as_json=args.json, title="{n} operation(s) awaiting approval", columns=COLUMNS)


def cmd_show(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        doc = approvals.show(session, None, args.id)
    if args.json:
        render.emit_json(doc)
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
    policies = approval_policies(settings)
    with ledger(settings) as sessions, sessions.begin() as session:
        row = approvals.approve(session, None, args.id, by=args.by, note=args.note, policies=policies)
        approval_id, policy_version = row.id, row.policy_version
    print(f"{args.id}: approved by {args.by} (approval {approval_id}, policy {policy_version})")
    return 0


def cmd_deny(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        approvals.deny(session, None, args.id, by=args.by, note=args.note)
    print(f"{args.id}: denied by {args.by}; cancelled, nothing sent")
    return 0
