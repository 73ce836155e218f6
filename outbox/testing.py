"""Test-only helpers: time as an input. Never imported by product code.

The ledger's clock is the database's (``outbox.ledger.clock.db_now``), so a test cannot move it by
patching Python. Every decision the ledger or a worker takes about time compares a stored
timestamp with the database's now: a lease has run out, a row is due, a deadline (counted from
``created_at``) has passed, a settle window (counted from the last attempt) is over. Moving every
stored timestamp back by N seconds is therefore, for each of those decisions, the same as N
seconds passing; that is what :func:`advance_ledger_clock` does, so tests check lease expiry,
Retry-After, settle windows and deadlines without sleeping.

It runs on PostgreSQL and SQLite alike without asking which one it talks to: the timestamps are
read with SQLAlchemy Core, shifted in Python and written back with Core updates. The columns are
every ``DateTime`` column of the ledger's models, so a column added later moves with the others.

Use it while the rows it moves are quiet (workers frozen, killed or waiting for a due time).
Each row is moved in its own short transaction, locking that row only, so a worker or relay
running meanwhile never deadlocks with it; a row that a still-open transaction inserts keeps its
own (real) times. Child rows (attempts, events, ...) move before their operations, so a
decision taken half-way through sees time between the old and the new, never beyond.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from sqlalchemy import Column, DateTime, Engine, Table, select, update
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc, to_db
from outbox.ledger.models import Base, Operation, core_table

__all__ = ["advance_ledger_clock", "ledger_timestamp_columns"]

_OPERATIONS = core_table(Operation)


def ledger_timestamp_columns() -> dict[Table, list[Column[dt.datetime]]]:
    """Every table of the ledger's models with its ``DateTime`` columns (tables without any left out),
    operations last."""
    found: dict[Table, list[Column[dt.datetime]]] = {}
    for table in reversed(Base.metadata.sorted_tables):  # children before the tables they refer to
        columns = [c for c in table.columns if isinstance(c.type, DateTime)]
        if columns:
            found[table] = columns
    if _OPERATIONS in found:  # evidence refers to operations without a foreign key: put it last by hand
        found[_OPERATIONS] = found.pop(_OPERATIONS)
    return found


def advance_ledger_clock(
    bind: Engine | Session, seconds: float, *, operation_ids: Collection[str] | None = None
) -> int:
    """Move the ledger's clock ``seconds`` forward: every stored timestamp moves that far back.

    ``bind``: an Engine (each row is moved and committed on its own) or a Session (the rows are
    moved inside its transaction; the caller commits). ``operation_ids``: move time for these
    operations only (their operations rows and the rows of any table with an ``operation_id``
    column), as if only their clock ran; rows of other operations, and tables that do not belong to
    an operation, stay as they are. Returns the number of rows moved (on PostgreSQL an operation's
    submit, claims and results are recorded on its operation and attempt rows, on SQLite they are
    event rows too: the count differs by backend, the history read back does not).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        raise ValueError(f"seconds must be a finite number, got {seconds!r}")
    if seconds < 0:
        raise ValueError(f"the clock only moves forward: seconds must be >= 0, got {seconds!r}")
    if seconds == 0:
        return 0
    delta = dt.timedelta(seconds=seconds)
    ids = None if operation_ids is None else list(operation_ids)
    moved = 0
    for table, columns in ledger_timestamp_columns().items():
        owner = table.c.id if table is _OPERATIONS else table.c.get("operation_id")
        if ids is not None and owner is None:
            continue
        keys = list(table.primary_key.columns)
        stmt = select(*keys).order_by(*keys)
        if ids is not None:
            assert owner is not None
            stmt = stmt.where(owner.in_(ids))
        with _transaction(bind) as conn:
            pks = [tuple(row) for row in conn.execute(stmt)]
        for pk in pks:
            where = [k == v for k, v in zip(keys, pk, strict=True)]
            with _transaction(bind) as conn:
                # Locks this one row (FOR UPDATE is left out where the database has no such thing),
                # so a concurrent writer's value is the one moved, not overwritten.
                row = conn.execute(select(*columns).where(*where).with_for_update()).one_or_none()
                if row is None:  # deleted meanwhile
                    continue
                values = {
                    c.name: to_db(shifted - delta)
                    for c, value in zip(columns, row, strict=True)
                    if (shifted := as_utc(value)) is not None
                }
                if values:
                    conn.execute(update(table).where(*where).values(values))
                    moved += 1
    return moved


@contextmanager
def _transaction(bind: Engine | Session) -> Iterator[Session]:
    """The caller's session as is, or a short transaction of our own on the engine."""
    if isinstance(bind, Session):
        yield bind
        return
    with Session(bind) as session, session.begin():
        yield session
