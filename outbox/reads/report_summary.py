"""Reconciliation reports kept in the ledger: their headline figures and findings.

``agent-outbox report`` (and beat's scheduled ``outbox.report``) records each run here; the metrics
exporter, the API and the console read the last one from the ledger, so the figures do not depend on
which host ran the report. The figures are counts and times; the findings list keys and references
as the report does (never arguments).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from outbox.ledger.clock import as_utc
from outbox.ledger.models import ReportRun

# Where a kept report holds its possible duplicates by business object, beside the discrepancies.
BY_OBJECT = "possible_duplicates_by_object"


@dataclass(frozen=True)
class ReportSummary:
    finished_at_s: float  # epoch seconds
    duplicate_effects: int
    discrepancies: int
    complete: bool
    # Its health figures (outbox/reads/report.py), None where the window held nothing to measure.
    operations: int = 0  # operations created in its window
    attributability: float | None = None  # failure_attributability.share
    auto_recovery: float | None = None  # auto_recovery.rate
    # The articles' figures (outbox/reads/counters.py, same_effect.py); None: a report from before them.
    possible_duplicates_by_object: int | None = None
    key_conflicts: int | None = None
    key_replays: int | None = None
    first_time_resolution: float | None = None  # first_time_resolution.ratio

    @property
    def duplicate_effect_ratio(self) -> float | None:
        """Duplicate effects per operation of the window (the seeds' duplicate-effect rate)."""
        return self.duplicate_effects / self.operations if self.operations else None


def record_report(
    session: Session, report: dict[str, Any], *, started_at: dt.datetime, finished_at: dt.datetime, ran_by: str
) -> int:
    """Keep ``report`` (the document workers.provider.listing_report.build_report returns); returns its id."""
    report = json.loads(json.dumps(report, default=str))  # plain JSON: times and decimals as text
    row = ReportRun(
        started_at=started_at,
        finished_at=finished_at,
        since=dt.datetime.fromisoformat(str(report["since"])),
        complete=bool(report["complete"]),
        discrepancies=int(report["discrepancy_count"]),
        duplicate_effects=int(report["health"]["duplicate_effects"]),
        by_tenant=dict(report.get("by_tenant") or {}),
        health=dict(report["health"]),
        # The possible duplicates by object are kept with the findings (not counted as discrepancies).
        findings=dict(report.get("discrepancies") or {})
        | {BY_OBJECT: list(report.get("possible_duplicates_by_object") or [])},
        ran_by=ran_by,
    )
    session.add(row)
    session.flush()
    return int(row.id)


def last_report(session: Session) -> ReportRun | None:
    """The last report; its findings (possibly thousands of rows of JSON) load only when read, so a
    metrics scrape or a console refresh that wants the figures does not fetch them."""
    stmt = (
        select(ReportRun).options(defer(ReportRun.findings)).order_by(ReportRun.finished_at.desc(), ReportRun.id.desc())
    )
    return session.execute(stmt.limit(1)).scalar()


def read_summary(session: Session) -> ReportSummary | None:
    """The last report's headline figures; None when no report ran yet (the gauges are then absent)."""
    row = last_report(session)
    if row is None:
        return None
    finished = as_utc(row.finished_at)
    assert finished is not None
    health = row.health or {}

    def figure(section: str, key: str) -> float | None:
        value = (health.get(section) or {}).get(key)
        return float(value) if isinstance(value, int | float) else None

    def count(key: str) -> int | None:
        value = health.get(key)
        return int(value) if isinstance(value, int) else None

    return ReportSummary(
        finished.timestamp(),
        row.duplicate_effects,
        row.discrepancies,
        row.complete,
        operations=int(health.get("operations") or 0),
        attributability=figure("failure_attributability", "share"),
        auto_recovery=figure("auto_recovery", "rate"),
        possible_duplicates_by_object=count("possible_duplicates_by_object"),
        key_conflicts=count("key_conflicts"),
        key_replays=count("key_replays"),
        first_time_resolution=figure("first_time_resolution", "ratio"),
    )


def report_json(row: ReportRun, *, tenant: str | None = None) -> dict[str, Any]:
    """A report run as the API shows it; ``tenant``: only that tenant's findings and counts."""
    findings = {
        kind: [f for f in items if tenant is None or f.get("tenant") == tenant]
        for kind, items in (row.findings or {}).items()
    }
    return {
        "report_id": row.id,
        "started_at": (as_utc(row.started_at) or row.started_at).isoformat(),
        "finished_at": (as_utc(row.finished_at) or row.finished_at).isoformat(),
        "since": (as_utc(row.since) or row.since).isoformat(),
        "complete": row.complete,
        "discrepancy_count": sum(len(v) for k, v in findings.items() if k != BY_OBJECT)
        if tenant
        else row.discrepancies,
        "duplicate_effects": row.duplicate_effects if tenant is None else len(findings.get("duplicates", [])),
        "by_tenant": row.by_tenant if tenant is None else {tenant: (row.by_tenant or {}).get(tenant, {})},
        "health": row.health if tenant is None else None,
        "discrepancies": findings,
        "ran_by": row.ran_by,
    }
