"""Ledger metrics, read at scrape time: a prometheus_client collector over the ledger.

Each scrape runs a few small read-only queries in one short transaction, all on indexes:

- ``outbox_operations{status}``: exact counts of the non-terminal statuses (the open work), one
  range of the ``(status, updated_at)`` index per status. Its cost follows the open work, not the
  table: a million finished rows cost nothing.
- ``outbox_operations_finished_recent{status}``: terminal statuses (succeeded,
  failed_before_commit, cancelled) that ended within ``terminal_window_s``. An exact all-time
  count would scan the whole index at every scrape (seconds at tens of millions of rows); the
  rate of endings comes exactly from the workers' ``outbox_outcomes_total`` counter instead.
  A terminal row is never updated again, so its ``updated_at`` is the time it ended.
- outcome_unknown backlog: count (above) and age of the oldest, since it was submitted (the
  partial index ``ix_outbox_operations_unknown`` holds exactly the backlog).
- lookups due: outcome_unknown operations (``RECONCILE_CLAIMABLE``) whose lookup is due and not
  held by a reconciler, and how long the oldest has waited since it came due: the reconciler's
  queue, what an autoscaler scales reconciler replicas on (the same partial index).
- with ``tenants`` > 0 (OUTBOX_METRICS_TENANTS), the oldest due age of that many tenants, those
  waiting longest (fairness, per tenant): one group-by over the due rows, so its cost follows the
  backlog in front of the workers, and the one labelled family the operator opts into;
- open handoffs: count and age of the oldest (the partial index ``ix_outbox_handoffs_open``); those
  nobody has taken for longer than ``unowned_after_s`` (OUTBOX_HANDOFF_UNOWNED_ALERT_S), per tenant
  and target (``targets``: each action's, from the actions file; "unknown" without it). Only cases
  past that age make a series: a tenant appears while one of its cases waits unowned.
- approvals pending: count and age of the oldest operation in ``awaiting_approval``.
- people, over ``terminal_window_s``: handoffs opened, the handoff ratio (handoffs opened over
  operations that ended or were handed over), and the human takeover time: a histogram of the
  handoffs resolved in the window by their age at resolution. Windowed, not cumulative: read its
  quantiles without ``rate()``. The handoffs table holds only operations a person had to see.
- the last reconciliation report's figures, from the ledger (``outbox.reads.report_summary``):
  duplicate effects and their ratio per operation, failure attributability and the auto-recovery
  rate, as the report defines them (outbox/reads/report.py), and the articles' figures: possible
  duplicates by business object, key conflicts, same-key replays and the first-time resolution ratio
  (outbox/reads/counters.py), so dashboard and report agree.

Ages come from the database clock (``db_age_s``), like every time in the ledger. A ledger that
does not answer gives ``outbox_ledger_up 0`` and a WARNING, never a failed scrape: the process
metrics beside it stay visible. Labels are statuses only (and tenants where configured, above):
never keys or arguments.

This module reads only the ledger (``outbox`` imports nothing from workers/ or breaker/).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc, db_age_s, db_now, db_scan_now
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Handoff, Operation, Run
from outbox.ledger.publish import due_condition
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import TERMINAL, HandoffStatus, Status
from outbox.reads.report_summary import ReportSummary, read_summary

log = logging.getLogger(__name__)

OPEN_STATUSES: tuple[str, ...] = tuple(s.value for s in Status if s not in TERMINAL)
TERMINAL_STATUSES: tuple[str, ...] = tuple(s.value for s in Status if s in TERMINAL)
# A scrape must never queue up behind a slow ledger: Prometheus' default scrape timeout is 10 s,
# and these queries take milliseconds when the indexes are used.
STATEMENT_TIMEOUT_MS = 2000
# A person's takeover time: minutes to days.
TAKEOVER_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 86400.0, 259200.0, 604800.0)


class LedgerCollector(Collector):
    def __init__(
        self,
        engine: Engine,
        *,
        terminal_window_s: float = 3600.0,
        tenants: int = 0,
        unowned_after_s: float = 1800.0,
        targets: Mapping[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.sessions = make_sessionmaker(engine)
        self.terminal_window_s = terminal_window_s
        self.tenants = tenants
        self.unowned_after_s = unowned_after_s
        self.targets = dict(targets or {})
        self._warned = False

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing is queried at registration time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("outbox_ledger_up", "1 if the ledger answered this scrape's queries, else 0")
        try:
            families = self._read_ledger()
        except SQLAlchemyError as exc:
            if not self._warned:
                log.warning("metrics: ledger unreachable; outbox_ledger_up=0", extra={"error": repr(exc)})
            self._warned = True
            families = []
            up.add_metric([], 0)
        else:
            if self._warned:
                log.warning("metrics: ledger reachable again")
            self._warned = False
            up.add_metric([], 1)
        yield up
        yield from families

    def _read_ledger(self) -> list[GaugeMetricFamily]:
        with self.sessions.begin() as session:
            driver_for(session).set_statement_timeout(session, STATEMENT_TIMEOUT_MS)
            open_counts = dict(
                session.execute(
                    select(Operation.status, func.count())
                    .where(Operation.status.in_(OPEN_STATUSES))
                    .group_by(Operation.status)
                ).all()
            )
            ended = dict(
                session.execute(
                    select(Operation.status, func.count())
                    .where(
                        Operation.status.in_(TERMINAL_STATUSES), Operation.updated_at >= db_now(-self.terminal_window_s)
                    )
                    .group_by(Operation.status)
                ).all()
            )
            unknown_age = session.execute(
                select(db_age_s(func.min(Operation.created_at))).where(Operation.status == Status.OUTCOME_UNKNOWN.value)
            ).scalar()
            # Due and not yet claimed: how far behind the workers are (the index of due rows).
            due_age = session.execute(
                select(db_age_s(func.min(Operation.next_attempt_at))).where(
                    Operation.status == Status.NOT_DISPATCHED.value, Operation.next_attempt_at <= db_scan_now()
                )
            ).scalar()
            tenant_ages = self._tenant_due_ages(session) if self.tenants else []
            # Lookups due and no reconciler on them: the reconciler's queue (what to scale it on).
            lookups_due, lookups_age = session.execute(
                select(func.count(), db_age_s(func.min(Operation.next_attempt_at))).where(due_condition(lookups=True))
            ).one()
            # Waiting for a person's approval: since they entered the wait (updated_at of the row).
            approvals_age = session.execute(
                select(db_age_s(func.min(Operation.updated_at))).where(
                    Operation.status == Status.AWAITING_APPROVAL.value
                )
            ).scalar()
            handoffs_open, handoff_age = session.execute(
                select(func.count(), db_age_s(func.min(Handoff.opened_at))).where(
                    Handoff.status == HandoffStatus.OPEN.value
                )
            ).one()
            # Open cases nobody took within the setting: a person should have (the alert's series).
            unowned = session.execute(
                select(Operation.tenant, Operation.action, func.count())
                .join(Handoff, Handoff.operation_id == Operation.id)
                .where(
                    Handoff.status == HandoffStatus.OPEN.value,
                    Handoff.owner.is_(None),
                    Handoff.opened_at <= db_now(-self.unowned_after_s),
                )
                .group_by(Operation.tenant, Operation.action)
            ).all()
            summary = read_summary(session)
            # Handoffs opened or resolved in the window (a small table: only what a person saw).
            since = db_now(-self.terminal_window_s)
            handoff_rows = session.execute(
                select(Handoff.opened_at, Handoff.resolved_at, Handoff.opened_at >= since).where(
                    (Handoff.opened_at >= since)
                    | ((Handoff.status == HandoffStatus.RESOLVED.value) & (Handoff.resolved_at >= since))
                )
            ).all()
            # Runs still moving, and runs waiting for a person (effects automation will not undo).
            run_counts = dict(
                session.execute(
                    select(Run.status, func.count())
                    .where(Run.status.in_([*(s.value for s in ACTIVE), RunStatus.NEEDS_PERSON.value]))
                    .group_by(Run.status)
                ).all()
            )

        ops = GaugeMetricFamily(
            "outbox_operations", "Operations in each non-terminal status (exact)", labels=["status"]
        )
        for status in OPEN_STATUSES:
            ops.add_metric([status], open_counts.get(status, 0))
        recent = GaugeMetricFamily(
            "outbox_operations_finished_recent",
            f"Operations that reached each terminal status in the last {self.terminal_window_s:g} s",
            labels=["status"],
        )
        for status in TERMINAL_STATUSES:
            recent.add_metric([status], ended.get(status, 0))
        backlog = GaugeMetricFamily(
            "outbox_outcome_unknown_backlog", "Operations parked in outcome_unknown (waiting for the reconciler)"
        )
        backlog.add_metric([], open_counts.get(Status.OUTCOME_UNKNOWN.value, 0))
        backlog_age = GaugeMetricFamily(
            "outbox_outcome_unknown_oldest_age_seconds",
            "Seconds since the oldest operation now in outcome_unknown was submitted (0 when none)",
        )
        backlog_age.add_metric([], max(float(unknown_age or 0.0), 0.0))
        due = GaugeMetricFamily(
            "outbox_oldest_due_age_seconds",
            "Seconds since the oldest due, unclaimed not_dispatched operation came due (0 when none): the "
            "backlog in front of the workers, seen before deadlines pass",
        )
        due.add_metric([], max(float(due_age or 0.0), 0.0))
        per_tenant = GaugeMetricFamily(
            "outbox_tenant_oldest_due_age_seconds",
            f"Seconds since each tenant's oldest due, unclaimed operation came due: the {self.tenants} tenants "
            "waiting longest (OUTBOX_METRICS_TENANTS), to see one tenant's backlog hold up another's",
            labels=["tenant"],
        )
        for tenant, age in tenant_ages:
            per_tenant.add_metric([tenant], max(float(age or 0.0), 0.0))
        lookups = GaugeMetricFamily(
            "outbox_lookups_due",
            "Operations whose lookup is due now and that no reconciler holds: the reconciler's backlog, "
            "beside the unknown ones waiting for a later re-check",
        )
        lookups.add_metric([], int(lookups_due))
        lookups_oldest = GaugeMetricFamily(
            "outbox_oldest_due_lookup_age_seconds",
            "Seconds since the oldest due lookup no reconciler holds came due (0 when none): how far behind "
            "the reconciler is",
        )
        lookups_oldest.add_metric([], max(float(lookups_age or 0.0), 0.0))
        handoffs = GaugeMetricFamily("outbox_handoffs_open", "Handoffs waiting for a person")
        handoffs.add_metric([], int(handoffs_open))
        handoffs_age = GaugeMetricFamily(
            "outbox_handoffs_oldest_open_age_seconds", "Seconds since the oldest open handoff was opened (0 when none)"
        )
        handoffs_age.add_metric([], max(float(handoff_age or 0.0), 0.0))
        unowned_family = GaugeMetricFamily(
            "outbox_handoffs_unowned",
            f"Open handoffs nobody has taken for longer than {self.unowned_after_s:g} s "
            "(OUTBOX_HANDOFF_UNOWNED_ALERT_S), per tenant and target",
            labels=["tenant", "target"],
        )
        per_case: dict[tuple[str, str], int] = {}
        for tenant, action, n in unowned:
            key = (str(tenant), self.targets.get(str(action), "unknown"))
            per_case[key] = per_case.get(key, 0) + int(n)
        for (tenant, target), n in sorted(per_case.items()):
            unowned_family.add_metric([tenant, target], n)
        approvals = GaugeMetricFamily("outbox_approvals_pending", "Operations waiting for a person's approval")
        approvals.add_metric([], open_counts.get(Status.AWAITING_APPROVAL.value, 0))
        approvals_oldest = GaugeMetricFamily(
            "outbox_approvals_oldest_pending_age_seconds",
            "Seconds since the oldest operation awaiting approval entered the wait (0 when none)",
        )
        approvals_oldest.add_metric([], max(float(approvals_age or 0.0), 0.0))
        runs = GaugeMetricFamily(
            "outbox_runs", "Multi-step runs still moving, or waiting for a person (needs_person)", labels=["status"]
        )
        for status in (*sorted(s.value for s in ACTIVE), RunStatus.NEEDS_PERSON.value):
            runs.add_metric([status], run_counts.get(status, 0))
        people = self._people(handoff_rows, finished=sum(ended.values()))
        return [
            ops,
            recent,
            backlog,
            backlog_age,
            due,
            *([per_tenant] if self.tenants else []),
            lookups,
            lookups_oldest,
            handoffs,
            handoffs_age,
            unowned_family,
            approvals,
            approvals_oldest,
            runs,
            *people,
        ] + list(self._report(summary))

    def _people(self, rows: Sequence[Any], *, finished: int) -> list[Any]:
        window = f"{self.terminal_window_s:g} s"
        opened = sum(1 for r in rows if r[2])
        opened_recent = GaugeMetricFamily(
            "outbox_handoffs_opened_recent", f"Handoffs opened (operations handed to a person) in the last {window}"
        )
        opened_recent.add_metric([], opened)
        out: list[Any] = [opened_recent]
        if finished + opened:
            ratio = GaugeMetricFamily(
                "outbox_handoff_ratio",
                f"Of the operations that ended or were handed to a person in the last {window}, the share handed "
                "to a person",
            )
            ratio.add_metric([], opened / (finished + opened))
            out.append(ratio)
        # Every resolved row here was resolved in the window (opened in it, or resolved in it).
        ages = [
            max((resolved - opened_at).total_seconds(), 0.0)
            for opened_at, resolved in ((as_utc(r[0]), as_utc(r[1])) for r in rows)
            if opened_at is not None and resolved is not None
        ]
        takeover = HistogramMetricFamily(
            "outbox_handoff_takeover_seconds",
            f"Handoffs resolved in the last {window} by their age at resolution (human takeover time; windowed: "
            "quantiles without rate())",
            buckets=[(f"{le:g}", sum(1 for a in ages if a <= le)) for le in TAKEOVER_BUCKETS] + [("+Inf", len(ages))],
            sum_value=sum(ages),
        )
        out.append(takeover)
        return out

    def _report(self, summary: ReportSummary | None) -> Iterator[GaugeMetricFamily]:
        if summary is None:
            return  # no report ran here yet: absent, not a made-up 0
        dup = GaugeMetricFamily(
            "outbox_report_duplicate_effects",
            "Duplicate effects (extra provider documents per key) found by the last report",
        )
        dup.add_metric([], summary.duplicate_effects)
        disc = GaugeMetricFamily("outbox_report_discrepancies", "Discrepancies found by the last report")
        disc.add_metric([], summary.discrepancies)
        complete = GaugeMetricFamily(
            "outbox_report_complete", "1 if the last report read every provider listing, else 0"
        )
        complete.add_metric([], 1 if summary.complete else 0)
        when = GaugeMetricFamily(
            "outbox_report_last_run_timestamp_seconds", "When the last report finished (Unix time)"
        )
        when.add_metric([], summary.finished_at_s)
        yield from (dup, disc, complete, when)
        figures = (
            ("outbox_report_duplicate_effect_ratio", summary.duplicate_effect_ratio,
             "Duplicate effects per operation of the last report's window (the duplicate-effect rate)"),
            ("outbox_failure_attributability_ratio", summary.attributability,
             "Of the last report's failed or handed-over operations, the share whose failure names a fault point "
             "(an error class and the provider's status code or a transport error)"),
            ("outbox_auto_recovery_ratio", summary.auto_recovery,
             "Of the last report's operations with a retryable failed attempt, the share that succeeded without "
             "a person"),
            ("outbox_first_time_resolution_ratio", summary.first_time_resolution,
             "Of the operations the last report's window settled, the share settled without a second attempt or "
             "a person"),
            ("outbox_report_possible_duplicates_by_object", summary.possible_duplicates_by_object,
             "Groups of operations with different keys on one business object, all succeeded, found by the last "
             "report (a caller minting a new key per retry?)"),
            ("outbox_report_key_conflicts", summary.key_conflicts,
             "Submits of the last report's window that reused a key with other arguments"),
            ("outbox_report_key_replays", summary.key_replays,
             "Submits of the last report's window answered with the operation their key already named"),
        )  # fmt: skip
        for name, value, doc in figures:
            if value is not None:  # nothing to measure in the window: absent, not a made-up figure
                family = GaugeMetricFamily(name, doc)
                family.add_metric([], value)
                yield family

    def _tenant_due_ages(self, session: Session) -> list[tuple[str, float | None]]:
        oldest = func.min(Operation.next_attempt_at)
        rows = session.execute(
            select(Operation.tenant, db_age_s(oldest))
            .where(Operation.status == Status.NOT_DISPATCHED.value, Operation.next_attempt_at <= db_scan_now())
            .group_by(Operation.tenant)
            .order_by(oldest)
            .limit(self.tenants)
        ).all()
        return [(str(tenant), age) for tenant, age in rows]
