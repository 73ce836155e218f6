"""The source articles' counters, read from the ledger for the reconciliation report.

- **key conflicts**: submits that reused a key with other arguments (``IdempotencyConflict``);
- **same-key replays**: submits answered with the operation their key already names;
  both counted at submit, outside the caller's transaction (outbox/ledger/key_uses.py), per minute;
- **first-time resolution**: of the operations settled in the window (finished succeeded,
  committed_evidence_degraded, failed_before_commit or failed_at_provider since its start), the
  share settled without a second attempt (``attempt_count`` at most 1: a breaker's or a limit's wait
  is refunded and not a second attempt) and without a person (no handoff). A lookup that settled a
  lost answer is not a second attempt; a person's approval is a rule, not a rescue, and does not
  count against it. Cancelled operations are not settled by the call: left out.

Each figure also per tenant (the console shows a tenant its own). ``report_figures`` adds the
possible duplicates by business object (outbox/reads/same_effect.py): the report's part of them all.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import case, exists, func, select
from sqlalchemy.orm import Session

from outbox.ledger.key_uses import KeyUse
from outbox.ledger.models import Handoff, Operation
from outbox.ledger.states import Status
from outbox.reads.same_effect import possible_duplicates

SETTLED = (
    Status.SUCCEEDED.value,
    Status.COMMITTED_EVIDENCE_DEGRADED.value,
    Status.FAILED_BEFORE_COMMIT.value,
    Status.FAILED_AT_PROVIDER.value,
)


def key_uses(session: Session, *, since: dt.datetime) -> dict[str, dict[str, int]]:
    """{tenant: {"conflicts": n, "replays": m}} over the minutes since ``since`` (its minute included)."""
    start = since.replace(second=0, microsecond=0)
    rows = session.execute(
        select(KeyUse.tenant, func.sum(KeyUse.conflicts), func.sum(KeyUse.replays))
        .where(KeyUse.minute >= start)
        .group_by(KeyUse.tenant)
    ).all()
    return {tenant: {"conflicts": int(c or 0), "replays": int(r or 0)} for tenant, c, r in rows}


def first_time_resolution(session: Session, *, since: dt.datetime) -> dict[str, dict[str, int]]:
    """{tenant: {"settled": n, "first_time": m}} (the module docstring says what counts)."""
    handed = exists().where(Handoff.operation_id == Operation.id)
    first = case((Operation.attempt_count <= 1, case((handed, 0), else_=1)), else_=0)
    rows = session.execute(
        select(Operation.tenant, func.count(), func.sum(first))
        .where(Operation.status.in_(SETTLED), Operation.finished_at >= since)
        .group_by(Operation.tenant)
    ).all()
    return {tenant: {"settled": int(n), "first_time": int(f or 0)} for tenant, n, f in rows}


def ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def counters(session: Session, *, since: dt.datetime) -> dict[str, Any]:
    """The report's counters, in total and ``by_tenant``."""
    uses = key_uses(session, since=since)
    settled = first_time_resolution(session, since=since)
    by_tenant: dict[str, dict[str, Any]] = defaultdict(dict)
    for tenant, u in uses.items():
        by_tenant[tenant] |= {"key_conflicts": u["conflicts"], "key_replays": u["replays"]}
    for tenant, f in settled.items():
        by_tenant[tenant]["first_time_resolution"] = f | {"ratio": ratio(f["first_time"], f["settled"])}
    total_settled = sum(f["settled"] for f in settled.values())
    total_first = sum(f["first_time"] for f in settled.values())
    return {
        "key_conflicts": sum(u["conflicts"] for u in uses.values()),
        "key_replays": sum(u["replays"] for u in uses.values()),
        "first_time_resolution": {
            "settled": total_settled,
            "first_time": total_first,
            "ratio": ratio(total_first, total_settled),
        },
        "by_tenant": dict(sorted(by_tenant.items())),
    }


def report_figures(
    session: Session, *, rules: Mapping[str, Sequence[str] | None], since: dt.datetime, window_s: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The possible duplicates by business object (the findings), and the report's health figures of
    this module: their count, the counters, and all of them per tenant (``by_tenant``)."""
    found = possible_duplicates(session, rules=rules, since=since, window_s=window_s)
    figures = counters(session, since=since)
    by_tenant: dict[str, dict[str, Any]] = defaultdict(dict, figures.pop("by_tenant"))
    for item in found:
        mine = by_tenant[item["tenant"]]
        mine["possible_duplicates_by_object"] = mine.get("possible_duplicates_by_object", 0) + 1
    health = {"possible_duplicates_by_object": len(found), **figures, "by_tenant": dict(sorted(by_tenant.items()))}
    return found, health
