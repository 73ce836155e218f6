"""The whole history of every operation, one view: ``outbox_history``.

Every move an operation makes leaves an event (who, why, from, to). Most are rows of
``outbox_operation_events``; on PostgreSQL the three every operation makes on its hot path are
recorded on rows written anyway: a worker's claim and the move its attempt's result made on the
attempt row (its ``claim_event_id``/``claimed_from`` and ``move_event_id``/``moved_to``/
``move_reason``, migration 0015), the submit on the operation row (``submit_event_id``/
``submitted_as``/``submit_reason``; its time is ``created_at``, its actor ``subject``, migration
0016): three row writes and three foreign-key checks fewer per operation.
The view spells those as the event rows they stand for, with ids drawn from the events' own
sequence when they were written, so ordering by id keeps the order the ledger wrote them in.
SQLite's driver still writes them as rows (those columns stay NULL): both read the same through
the view.

Every reader of an operation's history reads ``HistoryEvent``; ``OperationEvent`` is for writing.
Portable SQL: the same view on both backends (migrations 0015 and 0016 made it; a test compares).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import BigInteger, Connection, MetaData, String, Text, event, inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox.ledger.models import ATTEMPTS, HISTORY, OPERATION_EVENTS, OPERATIONS, TS, Base
from outbox.ledger.states import EventKind, Status

_DISPATCH = "kind = 'dispatch'"
HISTORY_SELECT = f"""
SELECT id, operation_id, at, from_status, to_status, fencing_token, event, reason, actor FROM {OPERATION_EVENTS}
UNION ALL
SELECT claim_event_id, operation_id, started_at, claimed_from,
    CASE WHEN {_DISPATCH} THEN '{Status.DISPATCHING.value}' ELSE claimed_from END, fencing_token,
    CASE WHEN {_DISPATCH} THEN '{EventKind.CLAIM.value}' ELSE '{EventKind.RECONCILE_CLAIM.value}' END,
    kind || ' attempt ' || attempt_number, worker
FROM {ATTEMPTS} WHERE claim_event_id IS NOT NULL
UNION ALL
SELECT move_event_id, operation_id, ended_at,
    CASE WHEN {_DISPATCH} THEN '{Status.DISPATCHING.value}' ELSE claimed_from END, moved_to, fencing_token,
    CASE WHEN {_DISPATCH} THEN '{EventKind.ATTEMPT_RESULT.value}' ELSE '{EventKind.LOOKUP_RESULT.value}' END,
    move_reason, worker
FROM {ATTEMPTS} WHERE move_event_id IS NOT NULL
UNION ALL
SELECT submit_event_id, id, created_at, NULL, submitted_as, 0, '{EventKind.SUBMIT.value}', submit_reason, subject
FROM {OPERATIONS} WHERE submit_event_id IS NOT NULL"""


@event.listens_for(Base.metadata, "after_create")
def _create_view(_metadata: MetaData, connection: Connection, tables: Any = None, **_: Any) -> None:
    # Made with the event and attempt tables (create_all of a subset, or of a ledger already there,
    # leaves it); the operations it also reads are theirs by foreign key, made first.
    made = {t.name for t in tables} if tables is not None else {OPERATION_EVENTS, ATTEMPTS}
    if {OPERATION_EVENTS, ATTEMPTS} <= made and HISTORY not in inspect(connection).get_view_names():
        connection.exec_driver_sql(f"CREATE VIEW {HISTORY} AS {HISTORY_SELECT}")


@event.listens_for(Base.metadata, "before_drop")
def _drop_view(_metadata: MetaData, connection: Connection, **_: Any) -> None:
    connection.exec_driver_sql(f"DROP VIEW IF EXISTS {HISTORY}")


class _Views(DeclarativeBase):
    """Read-only mappings of views, outside Base's metadata (the views are made by the listeners above)."""


class HistoryEvent(_Views):
    """A row of ``outbox_history``: the columns of ``OperationEvent``."""

    __tablename__ = HISTORY

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    operation_id: Mapped[str] = mapped_column(String(36))
    at: Mapped[dt.datetime] = mapped_column(TS)
    from_status: Mapped[str | None] = mapped_column(String(32))
    to_status: Mapped[str] = mapped_column(String(32))
    fencing_token: Mapped[int] = mapped_column(BigInteger)
    event: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(255))
