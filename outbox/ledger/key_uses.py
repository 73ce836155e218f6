"""Key uses: how often callers came back with a key, counted where it happens (submit).

- **same-key replays**: a submit answered with the operation its key already names (the same
  arguments): a caller that retries the right way;
- **key conflicts**: the same key with other arguments (``IdempotencyConflict``): a caller that reuses
  a key for another intent, or changed the arguments of its retry.

Both are the reconciliation report's counters (outbox/reads/key_figures.py), and through it the
exporter's and the console's. A plain intent's key only: a run's steps are keyed by the run.

**Counted outside the caller's transaction.** A conflict raises, and every caller takes back what it
wrote then (the HTTP API answers 409 and rolls back, a batch rolls back the item's savepoint, a tool
call answers with the first call): a count written inside would vanish with it. So ``note`` only
notes the use on the session, and when the session's outermost transaction ends (commit or rollback)
the notes are written in a short transaction of their own, on a connection of the same engine (the
session's connection is back in its pool by then, so SQLite's one writer is free). One upsert per
(tenant, action, minute) per transaction however many uses it noted; a key or an argument is never
stored. A write that fails (the ledger away, a connection lent by a framework that owns it) is logged
at INFO and dropped: this is a counter, never evidence. The minute comes from this process's clock:
a bucket of a counter, never a deadline.

Where the caller's transaction is not the session's to end (a session on a connection whose own
transaction goes on, Django's ``atomic()`` block: ``IN_CALLERS_TRANSACTION`` in ``Session.info``), a
second connection would wait for the caller's write lock (SQLite) or could not commit at all (a lent
connection): the use is counted in the caller's transaction instead, and a rollback takes it along.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from typing import Any, Literal

from sqlalchemy import DateTime, Engine, Index, Integer, String, event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapped, Session, SessionTransaction, mapped_column

from outbox.ledger.drivers import driver_for
from outbox.ledger.models import PREFIX, Base, core_table

log = logging.getLogger(__name__)

KEY_USES = PREFIX + "key_uses"
Kind = Literal["replays", "conflicts"]
REPLAYS: Kind = "replays"
CONFLICTS: Kind = "conflicts"
_NOTES = "outbox.key_uses"  # the session's notes (Session.info), written when its transaction ends
# Set in Session.info by a caller whose transaction the session does not own (producer/django/).
IN_CALLERS_TRANSACTION = "outbox.in_callers_transaction"


class KeyUse(Base):
    """Replays and conflicts of one tenant's keys of one action, in one minute."""

    __tablename__ = KEY_USES

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    action: Mapped[str] = mapped_column(String(200), primary_key=True)
    minute: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    replays: Mapped[int] = mapped_column(Integer)
    conflicts: Mapped[int] = mapped_column(Integer)


# The report reads a window of minutes across tenants.
Index(f"ix_{KEY_USES}_minute", KeyUse.minute)
_KU = core_table(KeyUse)


def note(session: Session, *, tenant: str, action: str, kind: Kind) -> None:
    """Count one use, written once the session's outermost transaction ends (the module docstring)."""
    if session.info.get(IN_CALLERS_TRANSACTION):
        record(session.connection(), Counter({(tenant, action, kind): 1}))
        return
    notes: Counter[tuple[str, str, str]] = session.info.setdefault(_NOTES, Counter())
    notes[(tenant, action, kind)] += 1


@event.listens_for(Session, "after_transaction_end")
def _write_notes(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None or transaction.nested:
        return  # a savepoint, or an inner transaction: the outermost one's end writes
    notes = session.info.pop(_NOTES, None)
    if not notes:
        return
    try:
        bind = session.get_bind()
        if isinstance(bind, Connection) and bind.in_transaction():
            record(bind, notes)  # the connection's own transaction goes on: counted in it
            return
        engine = bind.engine if isinstance(bind, Connection) else bind
        assert isinstance(engine, Engine)
        with engine.begin() as conn:
            record(conn, notes)
    except Exception as exc:  # noqa: BLE001 - a counter: never fail (or delay) the caller's work for it
        log.info("key uses not counted (%s: %s)", type(exc).__name__, exc, extra={"uses": sum(notes.values())})


def record(conn: Any, notes: Counter[tuple[str, str, str]], *, at: dt.datetime | None = None) -> None:
    """Add ``notes`` ({(tenant, action, kind): n}) to their minute's rows, in ``conn``'s transaction."""
    minute = (at or dt.datetime.now(dt.UTC)).replace(second=0, microsecond=0)
    per_row: dict[tuple[str, str], dict[str, int]] = {}
    for (tenant, action, kind), n in notes.items():
        per_row.setdefault((tenant, action), {REPLAYS: 0, CONFLICTS: 0})[kind] += n
    for (tenant, action), counts in sorted(per_row.items()):  # one order: two writers never deadlock
        stmt = driver_for(conn).upsert(_KU).values(tenant=tenant, action=action, minute=minute, **counts)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[_KU.c.tenant, _KU.c.action, _KU.c.minute],
                set_={REPLAYS: _KU.c.replays + counts[REPLAYS], CONFLICTS: _KU.c.conflicts + counts[CONFLICTS]},
            )
        )
