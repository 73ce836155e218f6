"""The latest reconciliation report, as a tenant may read it (its own findings and counts)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import ReportNotFound
from outbox.reads.report_summary import last_report, report_json


def latest(session: Session, tenant: str) -> dict[str, Any]:
    """When the last report ran (whichever host ran it), whether every listing was read, and this
    tenant's findings and counts."""
    row = last_report(session)
    if row is None:
        raise ReportNotFound("no report ran yet: agent-outbox report, or beat's hourly run")
    return report_json(row, tenant=tenant)
