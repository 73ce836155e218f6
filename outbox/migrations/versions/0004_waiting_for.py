"""operations.waiting_for: why a row is not due yet, as a typed column instead of reason text

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

Rows written before this revision get the value their reason text used to carry: a not_dispatched
row parked by an open breaker (its reason began "breaker") waits for the breaker, so that
``agent-outbox breakers reset`` still wakes it; a retry scheduled for later waits for its backoff or
the provider's Retry-After; outcome_unknown rows wait for a lookup; awaiting_approval rows for a
person. The text is read once, here, and never again.

Run it while no worker runs (as every migration here): a worker of the previous release would
claim and re-park rows without keeping this column up to date.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None



def upgrade() -> None:
    # A plain ADD COLUMN on both databases. Not a batch (table copy) on SQLite: recreating
    # ``operations`` there drops it first, and with foreign keys on that deletes every attempt and
    # event row. For the same reason no CHECK constraint: the values are the enum states.WaitingFor,
    # and only the ledger's own moves write them.
    op.add_column('operations', sa.Column('waiting_for', sa.String(16), nullable=True))
    # Parked by an open breaker and not yet due: what `breakers reset` wakes. (A reason that says
    # "... reset by ..." is a row a reset already woke: it is due, it waits for nothing.)
    op.execute(
        "UPDATE operations SET waiting_for = 'breaker' WHERE status = 'not_dispatched'"
        " AND reason LIKE 'breaker%' AND reason NOT LIKE '% reset by %'"
    )
    # A retry scheduled for later: on the provider's Retry-After when the last dispatch attempt
    # carried one (the old reason ends "(Retry-After)"), else on our backoff. Rows already due wait
    # for nothing: a re-dispatch after a lookup or a person's "not executed" is due at once.
    op.execute(
        "UPDATE operations SET waiting_for = CASE WHEN reason LIKE '%(Retry-After)' THEN 'retry_after'"
        " ELSE 'backoff' END"
        " WHERE status = 'not_dispatched' AND waiting_for IS NULL AND attempt_count > 0"
        " AND next_attempt_at > CURRENT_TIMESTAMP"
    )
    op.execute("UPDATE operations SET waiting_for = 'lookup' WHERE status = 'outcome_unknown'")
    op.execute("UPDATE operations SET waiting_for = 'approval' WHERE status = 'awaiting_approval'")


def downgrade() -> None:
    op.drop_column('operations', 'waiting_for')  # SQLite >= 3.35 drops a column in place
