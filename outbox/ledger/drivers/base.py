"""What a ledger driver does, and the plain records it is handed.

Business code (submit, claims, transitions, evidence, the relay) says *what* to write; a driver
says it in its database's terms. Two implement it: ``postgres.PostgresDriver`` (the catalogue of
statements in ``sql/*.sql``, sent through psycopg, or through SQLAlchemy when an application's
transaction runs on another driver) and ``sqlite.SqliteDriver`` (SQLAlchemy Core, one writer at a time). ``outbox.ledger.drivers.driver_for`` picks one; no other module asks which
database it runs on.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.fairness import Fairness
from outbox.ledger.states import RECONCILE_CLAIMABLE, AttemptKind, Status, WaitingFor
from outbox.ledger.writes import WriteSet, finalize_writes, settle_writes

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


@dataclass
class StaleRules:
    """When ``analyze_stale`` refreshes a table's planner statistics: once ``min_rows`` of its rows
    and ``share`` of them changed since its last analysis; or, a young table (fewer than
    ``young_rows`` rows when last analyzed, or never analyzed), once it has twice the rows it had
    then and ``young_first`` at least, however few changed. ``young``: the tables still young after
    the driver's look, set by it (empty where the database keeps no statistics)."""

    min_rows: int
    share: float
    young_rows: int = -2  # reltuples is -1 at least: no table young
    young_first: int = 0
    young: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class NewOperation:
    """An intent's row as submit writes it (times are offsets from the database's clock)."""

    id: str
    tenant: str
    idempotency_key: str
    provider_key: str
    action: str
    args: str
    args_digest: str
    subject: str
    run_id: str | None
    tool_call_id: str | None
    status: Status
    waiting_for: WaitingFor | None
    max_attempts: int | None
    deadline_s: float | None
    delay_s: float
    reason: str
    submitted_by: str | None = None
    key_space: str = "intent"  # 'run': a run's step or compensation (models.Operation.key_space)
    priority: int = 0  # higher is claimed sooner within its tenant (models.Operation.priority)
    traceparent: str | None = None  # W3C trace context (outbox/ledger/tracing.py)
    object_key: str | None = None  # the business object it touches (outbox/ledger/objects.py)
    budget_scope: str | None = None  # the conversation charged for it (outbox/ledger/budget_scopes.py)
    action_version: str | None = None  # the action's version at submit (outbox/actions/versions.py)


@dataclass(frozen=True)
class Inserted:
    """The times the database gave a row ``insert_operation`` wrote (its submit event is dated
    ``created_at``): with the :class:`NewOperation` it wrote, the whole new row, so a submit can be
    answered without reading the row back (outbox/reads/queries.py ``submitted_detail``)."""

    created_at: dt.datetime
    updated_at: dt.datetime
    next_attempt_at: dt.datetime
    deadline_at: dt.datetime | None


@dataclass(frozen=True)
class FinalizeWrite:
    """One worker's fenced finalize: its attempt report and the move, as parameters.

    ``params`` names every parameter of the write sets (outbox/ledger/writes.py) except ``to`` and
    ``stale`` (the driver adds them), plus operation_id, token, attempt_id, event, event_reason,
    actor and delay_s. ``guard``: the move claims "no effect" and holds only while no other
    attempt may have taken effect (effect_guard.py). ``source``: dispatching (a worker's finalize)
    or the claimed row's outcome_unknown / accepted (a reconciler's settlement: its lookup attempt
    and ``settle_writes``).
    """

    to: Status
    refund: bool
    guard: bool
    params: dict[str, Any]
    source: Status = Status.DISPATCHING

    def write_set(self) -> WriteSet:
        if self.source in RECONCILE_CLAIMABLE:
            return settle_writes(self.to)
        return finalize_writes(self.to, refund=self.refund)


class ClaimedRow(NamedTuple):
    """One claimed operation as a driver returns it (the PostgreSQL rows carry the same names)."""

    id: str
    fencing_token: int
    attempt_count: int
    tenant: str
    idempotency_key: str
    provider_key: str | None
    action: str
    args: str | None
    args_digest: str
    subject: str
    lease_expires_at: dt.datetime
    max_attempts: int | None
    deadline_at: dt.datetime | None
    created_at: dt.datetime
    cancel_requested: bool
    proven_absent_through: int
    updated_at: dt.datetime
    status: str  # as claimed: dispatching, or the lookup's outcome_unknown / accepted
    attempt_id: int
    number: int
    open_ambiguity: bool
    traceparent: str | None = None
    # The action's version at submit, and the request on record (outbox/ledger/request_record.py).
    action_version: str | None = None
    request_version: str | None = None
    request_method: str | None = None
    request_path: str | None = None
    request_body: str | None = None
    request_digest: str | None = None
    request_key_header: str | None = None
    # Who submitted it (``key:<id>``): a claim whose key was revoked since is not sent (outbox/ledger/authority.py).
    submitted_by: str | None = None
    # The conversation it is charged to (outbox/ledger/budget_charges.py): its retries are charged there.
    budget_scope: str | None = None
    # Not a column: with nothing on record, the versions the earlier attempts that may have left
    # were claimed under (request_record.left_versions_sql); None: a record, or none left.
    left_versions: str | None = None


class HotPath(Protocol):
    """A worker's way to the ledger for its claims and finalizes (outbox/ledger/hot_path.py)."""

    def one_statement(self) -> AbstractContextManager[Any]: ...

    def transaction(self) -> AbstractContextManager[Any]: ...

    def close(self) -> None: ...


class LedgerDriver(Protocol):
    name: str

    def make_engine(self, url: str, **kwargs: Any) -> Engine: ...

    def make_async_engine(self, url: str, **kwargs: Any) -> AsyncEngine:
        """The same database for an asyncio application (``producer.AsyncOutbox``); a URL of a
        driver that has no async mode opens the database through one that has."""
        ...

    def lock_for_migration(self, conn: Connection) -> None: ...

    def migrating(self, conn: Connection) -> AbstractContextManager[None]:
        """Around a migration, before its transaction begins (SQLite: foreign keys off)."""
        ...

    def set_statement_timeout(self, session: Session, ms: int) -> None: ...

    def hot_path(self, engine: Engine, sessions: sessionmaker[Session]) -> HotPath: ...

    def insert_operation(self, session: Any, new: NewOperation) -> Inserted | None:
        """Insert ``new`` and its submit event unless its tenant already has its key; the row's
        times when this call inserted it, None when the key was taken (nothing written)."""
        ...

    def notify_due(self, session: Any, operation_id: str) -> None:
        """Tell the relay (on commit) that this operation is due now, where the database can."""
        ...

    def claim(
        self,
        session: Any,
        kind: AttemptKind,
        *,
        worker: str,
        lease_s: float,
        limit: int,
        operation_ids: list[str] | None,
        also_due: int,
        fairness: Fairness | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> Sequence[Any]:
        """Rows in rank order. ``fairness`` (dispatch claims only; None: oldest first by priority,
        as for lookups): shared among tenants, or not, as it says. ``versions`` (dispatch claims
        only): the claiming worker's version of each action, written on each attempt row it opens
        (its row's action's; NULL for an action not in it); each row carries ``left_versions``."""
        ...

    def finalize(self, session: Any, writes: Sequence[FinalizeWrite]) -> list[tuple[bool, bool]]: ...

    def current_row(self, session: Any, operation_id: str) -> Any: ...

    def mark_attempt_stale(self, session: Any, attempt_id: int) -> None: ...

    def record_request(self, session: Any, operation_id: str, params: dict[str, Any]) -> bool:
        """Record the request an attempt sent (``params``: RequestRecord.params()) on the operation
        if none is on record, whatever its status and token (a finalize refused for a lost lease):
        never over a record (guarded in the UPDATE itself), its path and body only while the
        arguments are kept, the version as the operation's if it has none. Whether
        it recorded. Not the hot path: a refused finalize only."""
        ...

    def read_due(self, session: Any, operation_ids: Sequence[str]) -> Sequence[Any]: ...

    def attempt_log(self, session: Any, operation_ids: Sequence[str], columns: tuple[str, ...]) -> Sequence[Any]: ...

    def insert_evidence(self, session: Any, records: Sequence[dict[str, Any]]) -> None: ...

    def analyze_stale(
        self, conn: Connection, tables: Sequence[str], rules: StaleRules, seen: dict[str, int] | None = None
    ) -> list[str]:
        """Refresh the planner statistics of those ``tables`` stale by the ``rules``; returns the
        tables analyzed, and sets ``rules.young``.

        ``seen``: the caller's memory, kept here (a table's count of changes when it last analyzed
        it). A table not in it gets statistics for every column; one in it, for the columns its
        indexes key or filter on, at a third of the price (planner_stats.py says why)."""
        ...

    def upsert(self, table: Any) -> Any:
        """The dialect's INSERT for ``table``, with ``on_conflict_do_nothing`` / ``on_conflict_do_update``
        (both backends spell them alike; outbox/ledger/objects.py, budget_scopes.py)."""
        ...

    def insert_run(self, session: Session, values: dict[str, Any]) -> bool:
        """Insert a run unless its (tenant, run_key) exists; True if this call inserted it."""
        ...

    def mark_due(
        self,
        engine: Engine,
        status: Status,
        *,
        leased_ok: bool,
        batch: int,
        republish_after_s: float,
        fresh_grace_s: float,
        leading_since: dt.datetime | None,
        write: bool = True,
    ) -> Sequence[Any]: ...

    def mark_rung(self, engine: Engine, operation_ids: Sequence[str]) -> None: ...

    def listener(self, engine: Engine) -> Any: ...
