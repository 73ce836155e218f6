"""The ledger's tables (SQLAlchemy 2.0 typed models).

- ``outbox_operations``: one row per intent; the state machine's current position, lease and token.
- ``outbox_attempts``: one row per transport attempt (or lookup); evidence, written once, never
  overwritten.
- ``outbox_operation_events``: transitions with who and why (on PostgreSQL not the submits, claims and
  attempt results: their rows record them); ``outbox_history``, a view, has them all (ledger/history.py).

The ledger lives in the application's own database (its intents commit in the application's
transactions), so every object it creates there carries ``PREFIX``: the tables, and through
``NAMING`` their indexes and constraints (PostgreSQL names a serial column's sequence after its
table). An application's own ``runs`` or ``approvals`` table is never ours. SQL written as text
names the tables by these constants, never by spelling them again.

A new ledger is created from these models; one of an earlier release is brought to them by the
alembic migrations in ``migrations/versions`` (outbox/migrate.py). A test checks that both ways
give exactly these tables, indexes and constraint names.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox.ledger.authority_columns import ApproverIdentityColumns, RevocationColumns
from outbox.ledger.case_columns import HandoffCaseColumns, RetryLinkColumns
from outbox.ledger.request_columns import AttemptVersionColumn, RequestRecordColumns
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import RECONCILE_CLAIMABLE, AttemptClass, Resolution, Status

PREFIX = "outbox_"
OPERATIONS = PREFIX + "operations"
ATTEMPTS = PREFIX + "attempts"
OPERATION_EVENTS = PREFIX + "operation_events"
HANDOFFS = PREFIX + "handoffs"
EVIDENCE = PREFIX + "evidence"
HISTORY = PREFIX + "history"  # a view: events, and those recorded on attempts and operations
APPROVALS = PREFIX + "approvals"
API_KEYS = PREFIX + "api_keys"
RUNS = PREFIX + "runs"
REPORT_RUNS = PREFIX + "report_runs"

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUS_VALUES = ", ".join(f"'{s.value}'" for s in Status)
RUN_STATUS_VALUES = ", ".join(f"'{s.value}'" for s in RunStatus)
RUN_ACTIVE = "status IN (" + ", ".join(f"'{s.value}'" for s in sorted(ACTIVE)) + ")"
CLASS_VALUES = ", ".join(f"'{c.value}'" for c in AttemptClass)
RESOLUTION_VALUES = ", ".join(f"'{r.value}'" for r in Resolution)
KEY_SPACES = ("intent", "run")
KEY_SPACE_VALUES = ", ".join(f"'{k}'" for k in KEY_SPACES)
# What the reconciler claims (states.RECONCILE_CLAIMABLE), spelled once for the partial index and the claims.
RECONCILE_DUE = "status IN (" + ", ".join(f"'{s.value}'" for s in sorted(RECONCILE_CLAIMABLE)) + ")"
TS = DateTime(timezone=True)
# The late successes not yet applied, as the sweep's query spells them; they imply the partial
# index's condition (STALE_UNAPPLIED), which leaves out what a finalize changes (attempt_class), so
# a finalize can rewrite its attempt row in place (migration 0023).
UNAPPLIED_SUCCESS = "stale AND attempt_class = 'succeeded' AND applied_at IS NULL"
STALE_UNAPPLIED = "stale AND applied_at IS NULL"
ATTEMPTS_FILLFACTOR = 90
# BIGINT on PostgreSQL; SQLite only auto-increments a column declared exactly INTEGER.
BIGID = BigInteger().with_variant(Integer(), "sqlite")


def _where(condition: str) -> dict[str, Any]:
    """A partial index's condition, the same on both backends."""
    return {f"{db}_where": text(condition) for db in ("postgresql", "sqlite")}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Operation(RequestRecordColumns, RetryLinkColumns, Base):
    __tablename__ = OPERATIONS

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    idempotency_key: Mapped[str] = mapped_column(String(255))
    # The key the provider sees (outbox/ledger/provider_keys.py), rendered once at submit. NULL only on
    # rows submitted before migration 0005, whose requests carried the bare idempotency_key.
    provider_key: Mapped[str | None] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(200))
    # Canonical JSON text (exact decimals, sorted keys): what dispatch sends, byte-stable.
    args: Mapped[str | None] = mapped_column(Text)
    args_digest: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(255))
    # Who submitted it, as an identity separation of duties compares (``key:<api key id>`` for the HTTP
    # API, MCP over HTTP, the console), never the free-text subject. NULL: in-process, without one.
    submitted_by: Mapped[str | None] = mapped_column(String(255))
    # Whose key this is: a plain intent's ('intent') or a run's step or compensation ('run'); the two
    # never adopt each other's operations (outbox/ledger/submit.py).
    key_space: Mapped[str] = mapped_column(String(8), server_default=text("'intent'"))
    run_id: Mapped[str | None] = mapped_column(String(255))
    tool_call_id: Mapped[str | None] = mapped_column(String(255))
    # Higher is claimed sooner within its tenant; -100..100 checked at submit; not digested (a resubmit keeps the first).
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))
    # The W3C trace context it was submitted in (outbox/ledger/tracing.py): its later spans continue it.
    traceparent: Mapped[str | None] = mapped_column(Text)
    # The business object it touches, and the conversation charged for it (outbox/ledger/scope_models.py).
    object_key: Mapped[str | None] = mapped_column(String(255))
    budget_scope: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(32))
    # Why a row is not due yet (states.WaitingFor); NULL: nothing but its schedule. Code decides on this,
    # people read ``reason``. No CHECK: SQLite would copy the table (migration 0004 says why).
    waiting_for: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    fencing_token: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(TS)
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    # NULL = the action's budget (actions file) decides; set = this intent's own cap.
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    deadline_at: Mapped[dt.datetime | None] = mapped_column(TS)
    next_attempt_at: Mapped[dt.datetime] = mapped_column(TS)
    result_reference: Mapped[str | None] = mapped_column(String(255))
    result_digest: Mapped[str | None] = mapped_column(String(64))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error_class: Mapped[str | None] = mapped_column(String(32))
    last_error: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Dispatch attempts numbered up to this one were proven not executed by a lookup or a
    # person; only ambiguous attempts after it keep failed_before_commit out of reach.
    proven_absent_through: Mapped[int] = mapped_column(Integer, default=0)
    # When the relay last rang the doorbell for this row; a row due again (retry) or whose
    # doorbell is older than republish_after_s gets a new one. Lost messages are thus harmless.
    published_at: Mapped[dt.datetime | None] = mapped_column(TS)
    created_at: Mapped[dt.datetime] = mapped_column(TS)
    updated_at: Mapped[dt.datetime] = mapped_column(TS)
    finished_at: Mapped[dt.datetime | None] = mapped_column(TS)
    # The submit's event recorded here (PostgreSQL): its time is created_at, its actor subject (ledger/history.py).
    submit_event_id: Mapped[int | None] = mapped_column(BigInteger)
    submitted_as: Mapped[str | None] = mapped_column(String(32))
    submit_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("tenant", "idempotency_key"),
        CheckConstraint(f"status IN ({STATUS_VALUES})", name="status"),
        CheckConstraint(f"error_class IS NULL OR error_class IN ({CLASS_VALUES})", name="error_class"),
        CheckConstraint("fencing_token >= 0", name="fencing_token"),
        CheckConstraint(f"key_space IN ({KEY_SPACE_VALUES})", name="key_space"),
        CheckConstraint("attempt_count >= 0 AND (max_attempts IS NULL OR max_attempts >= 1)", name="attempts"),
        Index(f"ix_{OPERATIONS}_leases", "lease_expires_at", **_where("status = 'dispatching'")),
        Index(f"ix_{OPERATIONS}_unknown", "next_attempt_at", **_where(RECONCILE_DUE)),
        Index(f"ix_{OPERATIONS}_status_updated", "status", "updated_at"),
    )


_DUE_ROWS = _where("status = 'not_dispatched'")
# What is due, in claim order: only claimable rows are indexed, so the index stays small while the
# table grows to millions of finished operations. ``due``: what is due by time (counts, ages, an
# unfair claim); ``fair_due``: the fair claim's walk (drivers/sql/claim.sql): tenants with work due, then
# each one's rows in claim order.
Index(f"ix_{OPERATIONS}_due", Operation.next_attempt_at, **_DUE_ROWS)
Index(f"ix_{OPERATIONS}_fair_due", Operation.tenant, Operation.priority.desc(), Operation.next_attempt_at, **_DUE_ROWS)


class Attempt(AttemptVersionColumn, Base):
    __tablename__ = ATTEMPTS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    operation_id: Mapped[str] = mapped_column(ForeignKey(f"{OPERATIONS}.id", ondelete="CASCADE"))
    attempt_number: Mapped[int] = mapped_column(Integer)
    # dispatch = the business request; lookup = the reconciler asking the provider.
    kind: Mapped[str] = mapped_column(String(16), default="dispatch")
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    worker: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[dt.datetime] = mapped_column(TS)
    ended_at: Mapped[dt.datetime | None] = mapped_column(TS)
    request_digest: Mapped[str | None] = mapped_column(String(64))
    status_code: Mapped[int | None] = mapped_column(Integer)
    attempt_class: Mapped[str] = mapped_column(String(32), default=AttemptClass.PENDING.value)
    provider_request_id: Mapped[str | None] = mapped_column(String(255))
    provider_reference: Mapped[str | None] = mapped_column(String(255))
    response_digest: Mapped[str | None] = mapped_column(String(64))
    retry_after_s: Mapped[float | None] = mapped_column(Float)
    latency_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    # True when this result arrived after the worker had lost the operation (a zombie's late
    # answer): kept as evidence, never written over the operation row by its worker. A stale
    # success still settles the operation: evidence wins (outbox/evidence/late_successes.py).
    stale: Mapped[bool] = mapped_column(Boolean, default=False)
    # Bookkeeping, not evidence: when the ledger applied this stale success to its operation (or
    # handed the contradiction to a person). NULL on a stale success = not yet applied. On a stale
    # result that is not a success: when the sweep retired it (nothing to apply: late_successes.py).
    applied_at: Mapped[dt.datetime | None] = mapped_column(TS)
    # The claim, and the move its result made, recorded here, not as event rows: ledger/history.py.
    claim_event_id: Mapped[int | None] = mapped_column(BigInteger)
    claimed_from: Mapped[str | None] = mapped_column(String(32))
    move_event_id: Mapped[int | None] = mapped_column(BigInteger)
    moved_to: Mapped[str | None] = mapped_column(String(32))
    move_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("operation_id", "kind", "attempt_number"),
        CheckConstraint(f"attempt_class IN ({CLASS_VALUES})", name="attempt_class"),
        CheckConstraint("kind IN ('dispatch', 'lookup')", name="kind"),
        # Late results (a zombie's answer) not yet applied; the sweep applies the successes and
        # retires the rest (outbox/evidence/late_successes.py). Only those rows are indexed, so the
        # sweep stays cheap however large the table grows.
        Index(f"ix_{ATTEMPTS}_unapplied_successes", "id", **_where(STALE_UNAPPLIED)),
        # PostgreSQL: a tenth of each page left free for the finalize that rewrites a claim's row in
        # place (migration 0023 on ledgers made before it).
        {"postgresql_with": {"fillfactor": ATTEMPTS_FILLFACTOR}},
    )


class OperationEvent(Base):
    __tablename__ = OPERATION_EVENTS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    operation_id: Mapped[str] = mapped_column(ForeignKey(f"{OPERATIONS}.id", ondelete="CASCADE"), index=True)
    at: Mapped[dt.datetime] = mapped_column(TS)
    from_status: Mapped[str | None] = mapped_column(String(32))
    to_status: Mapped[str] = mapped_column(String(32))
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    event: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(255))


class Handoff(HandoffCaseColumns, Base):
    """The packet a person needs to take over an operation automation could not settle."""

    __tablename__ = HANDOFFS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    operation_id: Mapped[str] = mapped_column(ForeignKey(f"{OPERATIONS}.id", ondelete="CASCADE"), index=True)
    opened_at: Mapped[dt.datetime] = mapped_column(TS)
    reason: Mapped[str] = mapped_column(Text)
    # The five items of DESIGN.md: ids and key; every attempt; the raw last error and its class;
    # the suggested next step; the original intent with sensitive fields masked.
    packet: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="open")
    resolution: Mapped[str | None] = mapped_column(String(32))
    resolved_reference: Mapped[str | None] = mapped_column(String(255))
    resolved_by: Mapped[str | None] = mapped_column(String(255))
    resolved_at: Mapped[dt.datetime | None] = mapped_column(TS)
    note: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        CheckConstraint("status IN ('open', 'resolved')", name="status"),
        CheckConstraint(f"resolution IS NULL OR resolution IN ({RESOLUTION_VALUES})", name="resolution"),
        Index(f"ix_{HANDOFFS}_open", "opened_at", **_where("status = 'open'")),
        Index(f"ix_{HANDOFFS}_checks", "next_check_at", **_where("status = 'open' AND next_check_at IS NOT NULL")),
    )


class Evidence(Base):
    """Append-only proof that an effect happened (the default evidence sink)."""

    __tablename__ = EVIDENCE

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    operation_id: Mapped[str] = mapped_column(String(36), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    idempotency_key: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(200))
    args_digest: Mapped[str] = mapped_column(String(64))
    provider_reference: Mapped[str | None] = mapped_column(String(255))
    response_digest: Mapped[str | None] = mapped_column(String(64))
    attempt_log_digest: Mapped[str] = mapped_column(String(64))
    recorded_at: Mapped[dt.datetime] = mapped_column(TS)


class Approval(ApproverIdentityColumns, Base):
    """A person's decision on one operation (outbox/approvals/decisions.py): bound to its tenant, action, args
    digest and requesting subject, the policy version it was given under, and an expiry."""

    __tablename__ = APPROVALS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    operation_id: Mapped[str] = mapped_column(ForeignKey(f"{OPERATIONS}.id", ondelete="CASCADE"), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(200))
    args_digest: Mapped[str] = mapped_column(String(64))
    requested_by: Mapped[str] = mapped_column(String(255))
    policy_version: Mapped[str] = mapped_column(String(64))
    decision: Mapped[str] = mapped_column(String(16))
    approver: Mapped[str] = mapped_column(String(255))
    note: Mapped[str | None] = mapped_column(Text)
    decided_at: Mapped[dt.datetime] = mapped_column(TS)
    expires_at: Mapped[dt.datetime | None] = mapped_column(TS)

    __table_args__ = (CheckConstraint("decision IN ('approved', 'denied')", name="decision"),)


class ApiKey(RevocationColumns, Base):
    """An HTTP API key (outbox/access/keys.py): one tenant, some scopes; only the key's SHA-256 is stored."""

    __tablename__ = API_KEYS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # the key's first characters, to recognise it
    tenant: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[str] = mapped_column(String(255))  # comma-separated
    name: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(TS)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(TS)


class Run(Base):
    """A run: an ordered step table submitted at once (outbox/runs/lifecycle.py). Each step is an operation
    with a derived key, created when it becomes due; compensations are operations too."""

    __tablename__ = RUNS

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    run_key: Mapped[str] = mapped_column(String(255))
    subject: Mapped[str] = mapped_column(String(255))
    # Who submitted the run (operations.submitted_by): its steps carry it, for separation of duties.
    submitted_by: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(24))
    # The steps as accepted (outbox/runs/spec.py, JSON text): names, actions, canonical args,
    # compensations, and what the actions file said of each action (phase, irreversible).
    steps: Mapped[str | None] = mapped_column(Text)
    spec_digest: Mapped[str] = mapped_column(String(64))
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    deadline_at: Mapped[dt.datetime | None] = mapped_column(TS)
    priority: Mapped[int] = mapped_column(SmallInteger, server_default=text("0"))  # every step's (operations')
    # The operation the run waits for now (a step, or a compensation), and the step's name.
    current_op_id: Mapped[str | None] = mapped_column(String(36))
    holding_step: Mapped[str | None] = mapped_column(String(64))
    reason: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    compensate_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Every move of the run with who and why: [{at, from, to, reason, actor}].
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    resolved_by: Mapped[str | None] = mapped_column(String(255))
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(TS)
    updated_at: Mapped[dt.datetime] = mapped_column(TS)
    finished_at: Mapped[dt.datetime | None] = mapped_column(TS)
    # When retention removed the steps' arguments (outbox/privacy/retention.py); NULL = still there.
    purged_at: Mapped[dt.datetime | None] = mapped_column(TS)

    __table_args__ = (
        UniqueConstraint("tenant", "run_key"),
        CheckConstraint(f"status IN ({RUN_STATUS_VALUES})", name="status"),
        CheckConstraint("max_attempts IS NULL OR max_attempts >= 1", name="max_attempts"),
        # What the advance looks at: only moving runs are indexed.
        Index(f"ix_{RUNS}_active", "updated_at", postgresql_where=text(RUN_ACTIVE), sqlite_where=text(RUN_ACTIVE)),
    )


class ReportRun(Base):
    """One reconciliation report (agent-outbox report, or beat's hourly run): its headline figures and
    its findings, kept in the ledger so the exporter, the API and the console read the same report
    whichever host ran it (outbox/report_runs.py)."""

    __tablename__ = REPORT_RUNS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    started_at: Mapped[dt.datetime] = mapped_column(TS)
    finished_at: Mapped[dt.datetime] = mapped_column(TS, index=True)
    since: Mapped[dt.datetime] = mapped_column(TS)
    complete: Mapped[bool] = mapped_column(Boolean)
    discrepancies: Mapped[int] = mapped_column(Integer)
    duplicate_effects: Mapped[int] = mapped_column(Integer)
    by_tenant: Mapped[dict[str, Any]] = mapped_column(JSON)  # {tenant: {kind: count}}
    health: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The findings as the report lists them (keys and references, never arguments).
    findings: Mapped[dict[str, Any]] = mapped_column(JSON)
    ran_by: Mapped[str] = mapped_column(String(255))


def core_table(model: type[DeclarativeBase]) -> Table:
    """The Core Table behind a model, for statements built on it (typed: ``__table__`` is
    declared as a FromClause)."""
    table = model.__table__
    assert isinstance(table, Table)
    return table
