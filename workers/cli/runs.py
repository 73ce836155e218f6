"""``agent-outbox runs submit|list|show|cancel|resolve``: multi-step runs (outbox/runs/lifecycle.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from outbox.errors import InvalidIntent
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.envelope import loads_exact
from outbox.runs import lifecycle as runs
from outbox.settings import load_settings
from producer.client import key_rules_for
from workers.cli.ledger import open_engine

RUN_FIELDS = {"tenant", "run_key", "steps", "budget", "subject"}


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
    engine = open_engine(settings)
    try:
        with make_sessionmaker(engine).begin() as session:
            receipt = runs.submit_run(
                session,
                tenant=doc["tenant"],
                run_key=doc.get("run_key") or "",
                steps=doc.get("steps") or [],
                budget=doc.get("budget"),
                subject=subject,
                key_rules=key_rules_for(settings),
            )
    finally:
        engine.dispose()
    print(json.dumps(receipt.as_dict(), sort_keys=True))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise InvalidIntent("--limit", "must be from 1 to 1000")
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            rows = [
                runs.run_json(session, r)
                for r in runs.list_runs(session, status=args.status, tenant=args.tenant, limit=args.limit)
            ]
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    table = Table(title=f"{len(rows)} run(s)")
    for col in ("run_id", "tenant", "run_key", "status", "steps", "holding", "reason"):
        table.add_column(col, overflow="fold")
    for r in rows:
        done = sum(1 for s in r["steps"] if s["state"] in ("succeeded", "committed_evidence_degraded"))
        holding = r["holding"]
        table.add_row(
            r["run_id"],
            r["tenant"],
            r["run_key"],
            r["status"],
            f"{done}/{len(r['steps'])} done",
            f"{holding['step']} ({holding['status']})" if holding else "",
            r["reason"] or "",
        )
    Console(width=180).print(table)
    return 0


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
        print(f"  a person must review: {', '.join(doc['needs_person'])} (reconciliation_required)")
    print(f"  outcome: {doc['outcome']}: {doc['model_message']}")


def cmd_show(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine)() as session:
            doc = runs.run_json(session, runs.find_run(session, args.run, tenant=args.tenant))
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print_run(doc)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    settings = load_settings()
    engine = open_engine(settings)
    try:
        with make_sessionmaker(engine).begin() as session:
            run = runs.cancel_run(
                session,
                runs.find_run(session, args.run, tenant=args.tenant),
                actor=args.by,
                compensate=args.compensate,
                reason=args.reason,
                irreversible=getattr(key_rules_for(settings), "irreversible", frozenset()),
            )
            status, reason = run.status, run.reason
    finally:
        engine.dispose()
    print(f"{args.run}: {status} ({reason})")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    engine = open_engine(load_settings())
    try:
        with make_sessionmaker(engine).begin() as session:
            run = runs.resolve_run(
                session, runs.find_run(session, args.run, tenant=args.tenant), actor=args.by, note=args.note
            )
            status = run.status
    finally:
        engine.dispose()
    print(f"{args.run}: {status} by {args.by}")
    return 0
