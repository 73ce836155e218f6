"""Ledger commands: ``migrate``, ``submit``, ``ops list``, ``ops show``, ``ops cancel``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import IO, Any

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from outbox import migrate
from outbox.errors import ConfigError, IdempotencyConflict, InvalidIntent
from outbox.ledger.envelope import loads_exact
from outbox.ledger.intent import Intent
from outbox.ledger.states import MEANING, WAITING_MEANING, Status, WaitingFor
from outbox.ledger.submit import submit
from outbox.reads.queries import detail_of, operation_json
from outbox.service import operations
from outbox.settings import Settings, load_settings
from producer.client import action_rules_for
from workers.cli import render
from workers.cli.ledger import LedgerUnavailable, ledger, open_engine, shown

JSONL_FIELDS = {"tenant", "idempotency_key", "action", "args", "subject", "run_id", "tool_call_id", "priority"}
JSONL_REQUIRED = ("idempotency_key", "action", "args")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("migrate", help="create or upgrade the ledger schema")
    p.add_argument(
        "--ledgers",
        action="store_true",
        help="every ledger of OUTBOX_DATABASE_URLS in turn (a fleet's), a line each; exit 1 if one could not be reached",
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("submit", help="submit one intent (or many with --jsonl)")
    p.add_argument("--action", help="action name, e.g. payments.refund.create")
    p.add_argument("--key", help="idempotency key: the business identity of the intent")
    p.add_argument("--args", help="JSON object of arguments (numbers are kept exact)")
    p.add_argument("--tenant", help="tenant (default: OUTBOX_DEFAULT_TENANT)")
    p.add_argument("--subject", default="cli", help="who asks (default: cli)")
    p.add_argument("--run-id", help="agent run reference (informational)")
    p.add_argument("--tool-call-id", help="tool call reference (informational)")
    p.add_argument("--max-attempts", type=int, default=None, help="retry budget: attempts")
    p.add_argument("--deadline-s", type=float, default=None, help="retry budget: seconds from now")
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="-100..100, higher is claimed sooner among the tenant's due intents (default 0; a --jsonl line's own wins)",
    )
    p.add_argument("--jsonl", metavar="FILE", help="one intent per line (JSON object); - for stdin")
    p.set_defaults(func=cmd_submit)

    ops = sub.add_parser("ops", help="list, explain and cancel operations")
    ops_sub = ops.add_subparsers(dest="ops_command", metavar="SUBCOMMAND")
    p = ops_sub.add_parser("list", help="list operations, newest first")
    p.add_argument("--status", choices=[s.value for s in Status])
    p.add_argument("--tenant")
    p.add_argument("--action")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true", help="stable JSON for scripts")
    p.set_defaults(func=cmd_ops_list)
    p = ops_sub.add_parser("show", help="one operation with its attempts and history")
    p.add_argument("id_or_key", metavar="ID_OR_KEY")
    p.add_argument("--tenant")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ops_show)
    p = ops_sub.add_parser("cancel", help="cancel an operation that was not sent yet")
    p.add_argument("id_or_key", metavar="ID_OR_KEY")
    p.add_argument("--tenant")
    p.add_argument("--by", default="cli", help="who cancels (recorded in the history)")
    p.add_argument("--reason", default="cancel requested", help="why (recorded in the history)")
    p.set_defaults(func=cmd_ops_cancel)
    ops.set_defaults(func=lambda a: ops.print_help() or 2)


def cmd_migrate(args: argparse.Namespace) -> int:
    settings = load_settings()
    if not args.ledgers:
        _migrate(open_engine(settings, ensure_schema=False), "ledger", "OUTBOX_DATABASE_URL")
        return 0
    if not settings.database_urls:
        raise ConfigError(
            "--ledgers: OUTBOX_DATABASE_URLS is not set (name=url pairs, the ledgers a fleet drains); "
            "without --ledgers, migrate works on OUTBOX_DATABASE_URL's ledger"
        )
    failed = 0
    for name in settings.ledger_urls:
        try:
            _migrate(open_engine(settings, ensure_schema=False, ledger=name), f"ledger {name}", "OUTBOX_DATABASE_URLS")
        except LedgerUnavailable as exc:
            failed += 1
            print(f"ledger {name}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def _migrate(engine: Engine, which: str, variable: str) -> None:
    try:
        before = migrate.current_revision(engine)
        migrate.upgrade(engine)
        after = migrate.current_revision(engine)
    except OperationalError as exc:
        raise LedgerUnavailable(f"cannot reach the ledger: {exc.orig}; check {variable}") from exc
    finally:
        engine.dispose()
    where = shown(engine.url)
    print(
        f"{which} at {where}: schema {before or 'empty'} -> {after}"
        if before != after
        else f"{which} at {where}: schema already at {after}",
        flush=True,
    )


def _intent_from_flags(args: argparse.Namespace, tenant: str) -> dict[str, Any]:
    missing = [
        flag for flag, value in (("--action", args.action), ("--key", args.key), ("--args", args.args)) if not value
    ]
    if missing:
        raise InvalidIntent(missing[0], f"required (missing: {', '.join(missing)}); or use --jsonl FILE")
    intent: dict[str, Any] = dict(
        tenant=args.tenant or tenant,
        idempotency_key=args.key,
        action=args.action,
        args=loads_exact(args.args, field="--args"),
        subject=args.subject,
        run_id=args.run_id,
        tool_call_id=args.tool_call_id,
    )
    if args.priority is not None:
        intent["priority"] = args.priority
    return intent


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.max_attempts is not None:
        out["max_attempts"] = args.max_attempts
    if args.deadline_s is not None:
        out["deadline_s"] = args.deadline_s
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    settings = load_settings()
    if args.jsonl:
        if args.action or args.key or args.args:
            raise InvalidIntent("--jsonl", "cannot be combined with --action/--key/--args")
        return _submit_jsonl(args, settings)
    intent = Intent(**_intent_from_flags(args, settings.default_tenant), **_budget(args))
    with ledger(settings) as sessions, sessions.begin() as session:
        receipt = submit(session, intent, rules=action_rules_for(settings))
    print(json.dumps(receipt.as_dict(), sort_keys=True))
    return 0


def _lines(path: str) -> Iterator[tuple[int, str]]:
    stream: IO[str]
    if path == "-":
        stream = sys.stdin
    else:
        try:
            stream = open(path, encoding="utf-8")
        except OSError as exc:
            raise InvalidIntent("--jsonl", f"cannot read {path}: {exc.strerror}") from exc
    with stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                yield number, line


def _parse_line(text: str, default_tenant: str) -> dict[str, Any]:
    obj = loads_exact(text, field="line")
    if not isinstance(obj, dict):
        raise InvalidIntent("line", "must be a JSON object")
    unknown = sorted(set(obj) - JSONL_FIELDS)
    if unknown:
        raise InvalidIntent(unknown[0], f"unknown field; allowed: {', '.join(sorted(JSONL_FIELDS))}")
    for field in JSONL_REQUIRED:
        if field not in obj:
            raise InvalidIntent(field, "required")
    obj.setdefault("tenant", default_tenant)
    obj.setdefault("subject", "cli")
    return obj


def _submit_jsonl(args: argparse.Namespace, settings: Settings) -> int:
    rules = action_rules_for(settings)
    failed = {"invalid": 0, "idempotency_conflict": 0}
    with ledger(settings) as sessions:
        for number, text in _lines(args.jsonl):
            out: dict[str, Any]
            try:
                fields = _parse_line(text, args.tenant or settings.default_tenant)
                if args.priority is not None:
                    fields.setdefault("priority", args.priority)
                intent = Intent(**fields, **_budget(args))
                # One transaction per line: a bad line never takes good ones down with it.
                with sessions.begin() as session:
                    out = submit(session, intent, rules=rules).as_dict()
            except InvalidIntent as exc:
                failed["invalid"] += 1
                out = {"error": "invalid", "field": exc.field, "message": exc.reason}
            except IdempotencyConflict as exc:
                failed["idempotency_conflict"] += 1
                out = {
                    "error": "idempotency_conflict",
                    "field": "idempotency_key",
                    "operation_id": exc.operation_id,
                    "message": str(exc),
                }
            out["line"] = number
            print(json.dumps(out, sort_keys=True), flush=True)
    if failed["invalid"]:
        return 2
    return 3 if failed["idempotency_conflict"] else 0


OPS_COLUMNS: list[render.Column] = [
    ("operation_id", lambda r: r["operation_id"]),
    ("tenant", lambda r: r["tenant"]),
    ("idempotency_key", lambda r: r["idempotency_key"]),
    ("action", lambda r: r["action"]),
    ("status", lambda r: r["status"]),
    ("attempts", lambda r: r["attempts"]),
    ("token", lambda r: r["fencing_token"]),
    ("updated_at", lambda r: (r["updated_at"] or "")[:23]),
]


def cmd_ops_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise InvalidIntent("--limit", "must be >= 1")
    with ledger() as sessions, sessions() as session:
        found = operations.page(session, args.tenant, status=args.status, action=args.action, limit=args.limit)
        rows = [operation_json(op) for op in found.operations]
    return render.listing(rows, as_json=args.json, title="{n} operation(s), newest first", columns=OPS_COLUMNS)


def cmd_ops_show(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions() as session:
        detail = detail_of(session, operations.find(session, args.tenant, args.id_or_key)).as_json()
    if args.json:
        render.emit_json(detail)
        return 0
    console = render.console()
    status = detail["status"]
    console.print(f"[bold]{detail['operation_id']}[/]  {detail['tenant']} / {detail['idempotency_key']}")
    console.print(f"action {detail['action']}  subject {detail['subject']}  provider key {detail['provider_key']}")
    console.print(f"status [bold]{status}[/]: {MEANING[Status(status)]}")
    if detail["waiting_for"]:
        console.print(f"waiting for {detail['waiting_for']}: {WAITING_MEANING[WaitingFor(detail['waiting_for'])]}")
    console.print(
        f"reason: {detail['reason']}  attempts {detail['attempts']}/{detail['max_attempts']}  "
        f"token {detail['fencing_token']}  priority {detail['priority']}"
    )
    sent = detail["request"] or {}
    console.print(
        f"action version {detail['action_version'] or 'not recorded at submit'}; request under its key: "
        + (
            f"{sent['method'] or '(a hook connector)'} under version {sent['version']}, digest {sent['digest']}"
            if sent
            else "none sent yet"
        )
    )
    if detail["result"]:
        console.print(f"result: reference {detail['result']['reference']}")
    if detail["retry_of"]:
        console.print(f"retry of {detail['retry_of']} (a person retried it as this new intent)")
    if detail["retried_as"]:
        console.print(f"retried as {detail['retried_as']} (a new intent under a derived key)")
    if detail["error_class"]:
        console.print(f"last error ({detail['error_class']}): {detail['last_error']}")
    console.print(
        render.table(
            "attempts",
            ("#", "kind", "token", "worker", "class", "status", "provider ref", "retry-after", "latency", "error"),
            (
                (
                    a["attempt_number"],
                    a["kind"],
                    a["fencing_token"],
                    a["worker"],
                    a["class"] + (" (stale)" if a["stale"] else ""),
                    a["status_code"] or "",
                    a["provider_reference"],
                    _fmt_s(a["retry_after_s"]),
                    _fmt_s(a["latency_s"]),
                    (a["error"] or "")[:80],
                )
                for a in detail["attempt_log"]
            ),
        )
    )
    console.print(
        render.table(
            "history",
            ("at", "event", "from", "to", "token", "actor", "reason"),
            (
                ((e["at"] or "")[:23], e["event"], e["from"], e["to"], e["fencing_token"], e["actor"], e["reason"])
                for e in detail["history"]
            ),
        )
    )
    return 0


def _fmt_s(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}s"


def cmd_ops_cancel(args: argparse.Namespace) -> int:
    with ledger() as sessions, sessions.begin() as session:
        op = operations.find(session, args.tenant, args.id_or_key)
        status = operations.cancel(session, None, op.id, actor=args.by, reason=args.reason)
    if status is Status.CANCELLED:
        print(f"{op.id}: cancelled")
        return 0
    if status in (Status.NOT_DISPATCHED, Status.AWAITING_APPROVAL):
        print(
            f"{op.id}: is {status.value}; cancel requested is recorded and nothing more will be sent, but "
            "an earlier attempt may still take effect: the reconciler looks it up, then it ends cancelled "
            "(nothing can land), succeeded (it did) or with a person"
        )
        return 0
    print(
        f"{op.id}: is {status.value}; cancel requested is recorded, but a request already sent "
        "cannot be called back (a late success is still recorded as success)"
    )
    return 1 if status in (Status.SUCCEEDED, Status.FAILED_BEFORE_COMMIT) else 0
