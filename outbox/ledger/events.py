"""The one Core spelling of an ``operation_events`` row: the history a move leaves behind.

transitions.move, the breaker park/wake (waits.py) and the SQLite driver write through here; the
PostgreSQL driver records the submit on the operation row (drivers/sql/submit.sql), its claims and
the moves of attempt results on the attempt rows (drivers/sql/claim.sql, moves.sql), and writes a row here only for a move
no open attempt row can record. Read the whole history from ``outbox_history`` (history.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import insert
from sqlalchemy.orm import Session

from outbox.ledger.clock import db_now
from outbox.ledger.models import OperationEvent, core_table
from outbox.ledger.states import EventKind, Status

_EV = core_table(OperationEvent)
ROWS_PER_INSERT = 1000


def record_events(
    session: Session,
    rows: Sequence[tuple[str, int]],
    *,
    from_status: Status | str | None,
    to: Status,
    kind: EventKind | str,
    reason: str | None,
    actor: str,
    at: dt.datetime | None = None,
) -> None:
    """One event row per (operation id, fencing token) in ``rows``, all moving ``from_status`` ->
    ``to`` (``None``: the operation was created), in one INSERT on the database's clock (``at``: a
    time it already gave, e.g. the new row's created_at for its submit event)."""
    if not rows:
        return
    source = Status(from_status).value if from_status is not None else None
    # A bulk move (an emergency stop of 10,000 queued intents) in INSERTs of at most ROWS_PER_INSERT:
    # one VALUES list binds 8 parameters a row, and PostgreSQL takes at most 65,535 in a statement.
    for start in range(0, len(rows), ROWS_PER_INSERT):
        session.execute(
            insert(_EV).values(
                [
                    dict(
                        operation_id=operation_id,
                        at=db_now() if at is None else at,
                        from_status=source,
                        to_status=to.value,
                        fencing_token=token,
                        event=EventKind(kind).value,
                        reason=reason,
                        actor=actor,
                    )
                    for operation_id, token in rows[start : start + ROWS_PER_INSERT]
                ]
            )
        )
