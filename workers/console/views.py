"""What the console's pages show, read from the ledger for one tenant (no writes here)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import Handoff, Operation, Run
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import HandoffStatus, Status
from outbox.ledger.typed_outcome import outcome_of
from outbox.reads.queries import attempt_json, detail_of, event_json
from outbox.reads.report_summary import last_report

CHART_HOURS = 12


def counters(session: Session, tenant: str) -> dict[str, Any]:
    """The overview's figures (also polled by the page's script every few seconds)."""
    by_status = dict(
        session.execute(
            select(Operation.status, func.count()).where(Operation.tenant == tenant).group_by(Operation.status)
        ).all()
    )
    oldest_unknown = session.execute(
        select(func.min(Operation.created_at)).where(
            Operation.tenant == tenant, Operation.status == Status.OUTCOME_UNKNOWN.value
        )
    ).scalar()
    now = as_utc(session.execute(select(db_now())).scalar_one())
    handoffs = session.execute(
        select(func.count())
        .select_from(Handoff)
        .join(Operation, Operation.id == Handoff.operation_id)
        .where(Handoff.status == HandoffStatus.OPEN.value, Operation.tenant == tenant)
    ).scalar_one()
    runs = dict(
        session.execute(
            select(Run.status, func.count())
            .where(Run.tenant == tenant, Run.status.in_([*(s.value for s in ACTIVE), RunStatus.NEEDS_PERSON.value]))
            .group_by(Run.status)
        ).all()
    )
    report = last_report(session)
    # This tenant's counts per kind of finding (the report's by_tenant): the findings stay unread.
    found = dict((report.by_tenant or {}).get(tenant, {})) if report is not None else {}
    # And its own figures of the articles (outbox/reads/counters.py): a tenant sees only its own.
    mine = ((report.health or {}).get("by_tenant") or {}).get(tenant, {}) if report is not None else {}
    age = (now - as_utc(oldest_unknown)).total_seconds() if oldest_unknown is not None and now else 0.0  # type: ignore[operator]
    return {
        "by_status": {s.value: int(by_status.get(s.value, 0)) for s in Status},
        "unknown": int(by_status.get(Status.OUTCOME_UNKNOWN.value, 0)),
        "unknown_oldest_age_s": round(max(age, 0.0), 1),
        "handoffs_open": int(handoffs),
        "approvals_pending": int(by_status.get(Status.AWAITING_APPROVAL.value, 0)),
        "runs_needing_person": int(runs.get(RunStatus.NEEDS_PERSON.value, 0)),
        "runs_moving": sum(int(runs.get(s.value, 0)) for s in ACTIVE),
        "report": None
        if report is None
        else {
            "finished_at": (as_utc(report.finished_at) or report.finished_at).isoformat(),
            "complete": report.complete,
            "duplicates": int(found.get("duplicates", 0)),
            "discrepancies": sum(int(n) for n in found.values()),
            "possible_duplicates_by_object": int(mine.get("possible_duplicates_by_object", 0)),
            "key_conflicts": int(mine.get("key_conflicts", 0)),
            "key_replays": int(mine.get("key_replays", 0)),
            "first_time_resolution": (mine.get("first_time_resolution") or {}).get("ratio"),
        },
    }


def outcome_chart(session: Session, tenant: str, *, hours: int = CHART_HOURS) -> list[dict[str, Any]]:
    """Operations that finished in each of the last ``hours`` hours, by outcome (oldest hour first)."""
    rows = session.execute(
        select(Operation.finished_at, Operation.status).where(
            Operation.tenant == tenant, Operation.finished_at >= db_now(-hours * 3600.0)
        )
    ).all()
    now = as_utc(session.execute(select(db_now())).scalar_one())
    assert now is not None
    top = now.replace(minute=0, second=0, microsecond=0)
    buckets: list[dict[str, Any]] = [
        {"hour": (top - dt.timedelta(hours=h)).strftime("%H:00"), "counts": {}} for h in range(hours - 1, -1, -1)
    ]
    for finished, status in rows:
        at = as_utc(finished)
        if at is None:
            continue
        index = hours - 1 - int((top - at.replace(minute=0, second=0, microsecond=0)).total_seconds() // 3600)
        if 0 <= index < hours:
            word = outcome_of(status).value
            counts: dict[str, int] = buckets[index]["counts"]
            counts[word] = counts.get(word, 0) + 1
    return buckets


def timeline(session: Session, op: Operation) -> dict[str, Any]:
    """Every attempt and every transition of one operation, in time order, with its approval, its
    handoffs (their packets carry the intent with sensitive fields masked) and its run."""
    detail = detail_of(session, op)
    doc = detail.as_json()
    entries: list[dict[str, Any]] = []
    for a in detail.attempts:
        entries.append({"at": as_utc(a.started_at), "kind": "attempt", "attempt": attempt_json(a)})
    for e in detail.events:
        entries.append({"at": as_utc(e.at), "kind": "event", "event": event_json(e)})
    entries.sort(key=lambda x: (x["at"] or dt.datetime.min.replace(tzinfo=dt.UTC), 0 if x["kind"] == "event" else 1))
    handoffs = list(
        session.execute(select(Handoff).where(Handoff.operation_id == op.id).order_by(Handoff.id)).scalars()
    )
    run = session.get(Run, op.run_id) if op.run_id else None
    return {
        "op": doc,
        "outcome": outcome_of(op.status).value,
        "entries": entries,
        "handoffs": handoffs,
        "run": run if run is not None and run.tenant == op.tenant else None,
    }
