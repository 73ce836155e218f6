"""``agent-outbox runs submit|list|show|cancel|resolve``: multi-step runs (outbox/runs/lifecycle.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import loads_exact
from outbox.runs.lifecycle import run_json, submit_run
from outbox.service import runs
from outbox.settings import load_settings
from producer.client import action_rules_for
from workers.cli import render
from workers.cli.ledger import ledger

RUN_FIELDS = {"tenant", "run_key", "steps", "budget", "subject", "priority"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    r = sub.add_parser("runs", help="multi-step runs: submit, list, show, cancel (with compensation), resolve")
    s = r.add_subparsers(dest="runs_command", metavar="SUBCOMMAND")
    p = s.add_parser(
        "submit", help="submit a run from a JSON file ({tenant, run_key, steps, budget?}); '-' reads stdin"
    )
    p.add_argument(
        "--file", required=True, help="run.json: {tenant, run_key, steps: [{name, action, args, compensate?}], budget?}"
    )
    p.add_argument("--subject", help="who asks (default: the file's subject, or 'cli')")
    p.add_argument(
        "--priority", type=int, default=None, help="every step's priority, -100..100 (default: the file's, or 0)"
    )
    p.set_defaults(func=cmd_submit)
    p = s.add_parser("list", help="runs, newest first")
    p.add_argument(
        "--status", help="running, compensating, succeeded, failed, compensated, cancelled, needs_person, resolved"
    )
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)
    p = s.add_parser("show", help="a run's steps and their states, what holds it and why, the budget used")
    p.add_argument("run", metavar="RUN", help="run id or run key")
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)
    p = s.add_parser("cancel", help="cancel future steps (a step in flight keeps its late result)")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--tenant")
    p.add_argument("--compensate", action="store_true", help="also undo completed steps, in reverse order")
    p.add_argument("--by", default="cli", help="who cancels (recorded)")
    p.add_argument("--reason", default="cancel requested")
    p.set_defaults(func=cmd_cancel)
    p = s.add_parser("resolve", help="close a run in needs_person, saying what was done")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--tenant")
    p.add_argument("--by", required=True)
    p.add_argument("--note", required=True)
    p.set_defaults(func=cmd_resolve)
    r.set_defaults(func=lambda args: r.print_help() or 2)


def read_run_file(path: str, default_tenant: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidIntent("--file", f"cannot read {path}: {exc.strerror or exc}") from exc
    doc = loads_exact(text, field="--file")
    if not isinstance(doc, dict):
        raise InvalidIntent("--file", "must hold a JSON object {tenant, run_key, steps, budget?}")
    unknown = sorted(set(doc) - RUN_FIELDS)
    if unknown:
        raise InvalidIntent(unknown[0], f"unknown field; a run has {', '.join(sorted(RUN_FIELDS))}")
    doc.setdefault("tenant", default_tenant)
    return doc


def cmd_submit(args: argparse.Namespace) -> int:
    settings = load_settings()
    doc = read_run_file(args.file, settings.default_tenant)
    subject = args.subject or doc.pop("subject", None) or "cli"
    doc.pop("subject", None)
    with ledger(settings) as sessions, sessions.begin() as session:
        receipt = submit_run(
            session,
            tenant=doc["tenant"],
            run_key=doc.get("run_key") or "",
            steps=doc.get("steps") or [],
            budget=doc.get("budget"),
            subject=subject,
            rules=action_rules_for(settings),
            priority=args.priority if args.priority is not None else doc.get("priority", 0),
        )
    print(json.dumps(receipt.as_dict(), sort_keys=True))
    return 0


def _done(r: dict[str, Any]) -> str:
    done = sum(1 for s in r["steps"] if s["state"] in ("succeeded", "committed_evidence_degraded"))
    return f"{done}/{len(r['steps'])} done"


COLUMNS: list[render.Column] = [
    ("run_id", lambda r: r["run_id"]),
    ("tenant", lambda r: r["tenant"]),
    ("run_key", lambda r: r["run_key"]),
    ("status", lambda r: r["status"]),
    ("steps", _done),
    ("holding", lambda r: f"{r['holding']['step']} ({r['holding']['status']})" if r["holding"] else ""),
    ("reason", lambda r: r["reason"]),
]


def cmd_list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise InvalidIntent("--limit", "must be from 1 to 1000")
    with ledger() as sessions, sessions() as session:
        rows = [run_json(session, r) for r in runs.listing(session, args.tenant, status=args.status, limit=args.limit)]
    return render.listing(rows, as_json=args.json, title="{n} run(s)", columns=COLUMNS)


def print_run(doc: dict[str, Any]) -> None:
    print(f"run {doc['run_id']}  {doc['tenant']} / {doc['run_key']}: {doc['status']} ({doc['meaning']})")
    print(f"  reason: {doc['reason']}")
    if doc["holding"]:
        h = doc["holding"]
        print(f"  held by step {h['step']}: operation {h['operation_id']} is {h['status']} ({h['why']})")
    b = doc["budget"]
    cap = f" of {b['max_attempts']}" if b["max_attempts"] else ""
    print(
        f"  budget: {b['used']}{cap} attempts used ({b['dispatches']} sends, {b['retries']} of them retries; "
        f"{b['lookups']} lookups)" + (f"; deadline {b['deadline_at']}" if b["deadline_at"] else "")
    )
    for i, s in enumerate(doc["steps"], start=1):
        tags = ", ".join(t for t in (s["phase"], "irreversible" if s["irreversible"] else None) if t)
        op = s["operation"]
        ref = f" ref {op['result_reference']}" if op and op["result_reference"] else ""
        print(f"  {i}. {s['name']:<16} {s['action']:<28} {s['state']}{ref}" + (f" [{tags}]" if tags else ""))
        comp = s["compensation"]
        if comp and comp["operation"]:
            c = comp["operation"]
            print(
                f"       compensation {comp['action']}: {c['status']}"
                + (f" ref {c['result_reference']}" if c["result_reference"] else "")
            )
    if doc["waiting_for_person"]:
        print(f"  a person must review: {', '.join(doc['waiting_for_person'])} (reconciliation_required)")
    print(f"  outcome: {doc['outcome']}: {doc['model_message']}")


def cmd_show(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        doc = run_json(session, runs.find(session, args.tenant, args.run))
    if args.json:
        render.emit_json(doc)
    else:
        print_run(doc)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    settings = load_settings()
    with ledger(settings) as sessions, sessions.begin() as session:
        run = runs.cancel(
            session,
            None,
            runs.find(session, args.tenant, args.run).id,
            actor=args.by,
            compensate=args.compensate,
            reason=args.reason,
            irreversible=getattr(action_rules_for(settings), "irreversible", frozenset()),
        )
        status, reason = run.status, run.reason
    print(f"{args.run}: {status} ({reason})")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        run = runs.resolve(session, None, runs.find(session, args.tenant, args.run).id, actor=args.by, note=args.note)
        status = run.status
    print(f"{args.run}: {status} by {args.by}")
    return 0
