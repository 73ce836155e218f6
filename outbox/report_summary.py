"""The last reconciliation report's headline figures, kept where the metrics exporter can read them.

``agent-outbox report`` writes them after every run to ``OUTBOX_DATA_DIR/report-summary.json``
(atomically: a scrape never reads half a file); the ledger collector exposes them as gauges. Only
counts and times go in: no keys, no references, no arguments.

Limit: the file lives on the machine (container) that ran the report. In docker-compose, run the
report in the ``metrics`` service (``docker compose exec metrics agent-outbox report``), or the
exporter keeps showing the previous figures (their ``outbox_report_last_run_timestamp_seconds``
says how old they are).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_NAME = "report-summary.json"


@dataclass(frozen=True)
class ReportSummary:
    finished_at_s: float  # epoch seconds
    duplicate_effects: int
    discrepancies: int
    complete: bool


def summary_path(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def write_summary(path: Path, report: dict[str, Any], *, finished_at_s: float) -> ReportSummary:
    """Keep the figures of ``report`` (the document ``downstream.listing_report.build_report`` returns)."""
    summary = ReportSummary(
        finished_at_s=finished_at_s,
        duplicate_effects=int(report["health"]["duplicate_effects"]),
        discrepancies=int(report["discrepancy_count"]),
        complete=bool(report["complete"]),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-summary.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(summary.__dict__, out)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return summary


def read_summary(path: Path) -> ReportSummary | None:
    """None when no report ran here yet (or the file is unreadable: the gauges are then absent)."""
    try:
        doc = json.loads(path.read_text())
        return ReportSummary(
            float(doc["finished_at_s"]), int(doc["duplicate_effects"]), int(doc["discrepancies"]), bool(doc["complete"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
