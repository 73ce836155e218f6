"""``agent-outbox report``: the reconciliation report (ledger vs provider listings) and health figures."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy.exc import SQLAlchemyError

from outbox.errors import InvalidIntent
from outbox.reads.report_summary import record_report
from outbox.settings import load_settings
from workers.cli.ledger import ledger
from workers.provider.listing_report import build_report, dumps
from workers.wiring.builders import load_actions_for

UTC = dt.UTC
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

EPILOG = """\
Compares the ledger with what each provider lists (actions that declare a `list` request) and
prints: record-without-document, document-without-record, duplicates (more than one document per
business key), operations whose own attempts contradict their state (e.g. a confirmed success
beside failed_before_commit), possible duplicates by business object (two keys, one object -- the
action's `object` or `report.same_effect_when` -- both succeeded within --same-object-window; for a
person to review, not counted as discrepancies), and the health figures (duplicate effects, failure
attributability, auto-recovery rate, key conflicts, same-key replays, first-time resolution, handoffs
and time to resolution, retries per target).

exit status:
  0  no discrepancy found (and every listing was read)
  1  discrepancies found, or a listing could not be read (the report is incomplete)
  2  bad input (--since, settings, actions file)
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "report",
        help="reconciliation report: ledger vs provider, and health figures",
        description="Reconciliation report: the ledger compared with the providers' listings.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--since",
        default="24h",
        metavar="T",
        help="window start: ISO timestamp (2026-11-29T10:00:00Z) or a duration ago (24h, 30m, 7d); default 24h",
    )
    p.add_argument(
        "--same-object-window",
        default=None,
        metavar="D",
        help="possible duplicates by business object: two successes on one object at most this far apart "
        "(24h, 30m, 7d; default OUTBOX_REPORT_SAME_OBJECT_WINDOW_S, 24h)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the report as one JSON object (see workers/provider/listing_report.py)",
    )
    p.set_defaults(func=cmd_report)


def parse_since(text: str, *, now: dt.datetime) -> dt.datetime:
    match = _DURATION.match(text.strip())
    if match:
        return now - dt.timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    try:
        value = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidIntent("--since", f"{text!r} is neither an ISO timestamp nor a duration like 24h / 30m") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def parse_duration_s(text: str, flag: str) -> float:
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise InvalidIntent(flag, f"{text!r} is not a duration like 24h / 30m / 7d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def cmd_report(args: argparse.Namespace) -> int:
    now = dt.datetime.now(UTC)
    since = parse_since(args.since, now=now)
    settings = load_settings()
    window_s = settings.report_same_object_window_s
    if args.same_object_window is not None:
        window_s = parse_duration_s(args.same_object_window, "--same-object-window")
    actions = load_actions_for(settings)
    with ledger(settings) as sessions:
        with sessions() as session:
            report = build_report(session, actions, since=since, now=now, same_object_window_s=window_s)
        keep_report(sessions, report, started_at=now, ran_by="cli")
    if args.json:
        print(dumps(report))
    else:
        render(report)
    return 1 if report["discrepancy_count"] or not report["complete"] else 0


def keep_report(sessions: Any, report: dict[str, Any], *, started_at: dt.datetime, ran_by: str) -> None:
    """Record the report in the ledger, for the exporter, the API and the console
    (outbox/reads/report_summary.py); never fails the report itself."""
    try:
        with sessions.begin() as session:
            record_report(session, report, started_at=started_at, finished_at=dt.datetime.now(UTC), ran_by=ran_by)
    except SQLAlchemyError as exc:
        print(f"agent-outbox: the report was not kept in the ledger ({exc})", file=sys.stderr)


def render(report: dict[str, object]) -> None:
    console = Console(width=160, highlight=False)
    d = report["discrepancies"]
    assert isinstance(d, dict)
    console.print(
        f"[bold]reconciliation report[/] since {report['since']}  ({report['discrepancy_count']} discrepancies)"
    )
    listings = Table(title="provider listings")
    for col in ("target", "actions", "request", "documents", "pages", "error"):
        listings.add_column(col, overflow="fold")
    for row in report["listings"]:  # type: ignore[attr-defined]
        listings.add_row(
            row["target"],
            ", ".join(row["actions"]),
            row["request"],
            str(row["documents"]),
            str(row["pages"]),
            row["error"] or "",
        )
    console.print(listings)
    if report["actions_without_listing"]:
        console.print("not compared (no `list` request): " + ", ".join(report["actions_without_listing"]))  # type: ignore[arg-type]
    if report["too_recent"]:
        console.print(f"{report['too_recent']} success(es) younger than the settle window: not compared yet")

    t = Table(title=f"record without document ({len(d['record_without_document'])})")
    for col in ("operation", "tenant", "key", "action", "status", "reference", "finished"):
        t.add_column(col, overflow="fold")
    for r in d["record_without_document"]:
        t.add_row(
            r["operation_id"],
            r["tenant"],
            r["idempotency_key"],
            r["action"],
            r["status"],
            r["reference"] or "",
            (r["finished_at"] or "")[:19],
        )
    console.print(t)
    t = Table(title=f"document without record ({len(d['document_without_record'])})")
    for col in ("target", "key", "reference", "status", "why"):
        t.add_column(col, overflow="fold")
    for r in d["document_without_record"]:
        t.add_row(r["target"], r["idempotency_key"] or "", r["reference"] or "", str(r["status"]), r["why"])
    console.print(t)
    t = Table(title=f"duplicates: more than one document per key ({len(d['duplicates'])})")
    for col in ("target", "key", "documents", "references"):
        t.add_column(col, overflow="fold")
    for r in d["duplicates"]:
        t.add_row(r["target"], r["idempotency_key"], str(r["count"]), ", ".join(x or "?" for x in r["references"]))
    console.print(t)
    t = Table(title=f"state contradicted by the operation's own attempts ({len(d['state_contradictions'])})")
    for col in ("operation", "key", "status", "attempt", "why"):
        t.add_column(col, overflow="fold")
    for r in d["state_contradictions"]:
        a = r["attempt"]
        t.add_row(
            r["operation_id"],
            r["idempotency_key"],
            r["status"],
            ""
            if a is None
            else f"{a['kind']} {a['attempt_number']} token {a['fencing_token']}: {a['class']}"
            + (f" {a['reference']}" if a["reference"] else ""),
            r["why"],
        )
    console.print(t)

    by_object = report.get("possible_duplicates_by_object") or []
    assert isinstance(by_object, list)
    t = Table(title=f"possible duplicates by business object: two keys, one object, both succeeded ({len(by_object)})")
    for col in ("tenant", "action", "object", "operations (key: reference)"):
        t.add_column(col, overflow="fold")
    for r in by_object:
        ops = "; ".join(f"{o['idempotency_key']}: {o['reference'] or '?'}" for o in r["operations"])
        t.add_row(r["tenant"], r["action"], r["object"], ops)
    console.print(t)

    h = report["health"]
    assert isinstance(h, dict)
    fa, ar, ho = h["failure_attributability"], h["auto_recovery"], h["handoffs"]
    t = Table(title=f"health ({h['operations']} operations in the window)")
    t.add_column("figure")
    t.add_column("value", overflow="fold")
    t.add_row("duplicate effects", str(h["duplicate_effects"]))
    t.add_row("failure attributability", _share(fa["share"]) + f" ({fa['attributable']}/{fa['operations']})")
    t.add_row("auto-recovery rate", _share(ar["rate"]) + f" ({ar['recovered']}/{ar['operations']})")
    ft = h.get("first_time_resolution") or {"ratio": None, "first_time": 0, "settled": 0}
    t.add_row("first-time resolution", _share(ft["ratio"]) + f" ({ft['first_time']}/{ft['settled']})")
    t.add_row("key conflicts (same key, other arguments)", str(h.get("key_conflicts", 0)))
    t.add_row("same-key replays", str(h.get("key_replays", 0)))
    t.add_row("possible duplicates by business object", str(h.get("possible_duplicates_by_object", 0)))
    ttr = ho["time_to_resolution_s"]
    t.add_row(
        "handoffs",
        f"{ho['open']} open, {ho['resolved']} resolved; time to resolution median "
        f"{_secs(ttr['median'])}, max {_secs(ttr['max'])}",
    )
    for target, counts in h["retries_by_target"].items():
        t.add_row(f"retries: {target}", f"{counts['retries']} ({counts['billable']} reached the provider)")
    console.print(t)


def _share(value: object) -> str:
    return "n/a" if value is None else f"{float(value) * 100:.1f}%"  # type: ignore[arg-type]


def _secs(value: object) -> str:
    return "n/a" if value is None else f"{float(value):.1f}s"  # type: ignore[arg-type]
