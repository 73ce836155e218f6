"""A submit's event recorded on the operation row; ``outbox_history`` shows it as the event row it was

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04

On PostgreSQL every submit wrote two rows: the operation and its "submit" event, which says again
what the operation row knows (when: created_at, who: subject) plus the status it entered and the
reason. The event row cost a heap insert, two index entries and a foreign-key check that locks the
operation row just inserted (bench/README.md, issue 35). From this revision the submit records it
on the operation row:

- ``outbox_operations.submit_event_id`` (BIGINT): the event's id, drawn from the events' own
  sequence (so the history keeps the order it was written in);
- ``submitted_as`` (VARCHAR 32): the status the submit entered (not_dispatched, awaiting_approval);
- ``submit_reason`` (TEXT): the event's reason.

NULL on every existing row (their submit events are rows) and on rows of the SQLite driver, which
still writes event rows. Nothing else changes: ``at`` is the row's created_at, the actor its subject,
both written once. The view ``outbox_history`` gains the branch that spells these as event rows.

Added in place on both backends (nullable columns; the view is made again): no table copy. The
downgrade writes every recorded submit as an event row before the columns go.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

# The view as 0015 made it, and as this revision makes it (outbox/ledger/history.py HISTORY_SELECT
# is the head's spelling).
HISTORY_0015 = """
SELECT id, operation_id, at, from_status, to_status, fencing_token, event, reason, actor FROM outbox_operation_events
UNION ALL
SELECT claim_event_id, operation_id, started_at, claimed_from,
    CASE WHEN kind = 'dispatch' THEN 'dispatching' ELSE claimed_from END, fencing_token,
    CASE WHEN kind = 'dispatch' THEN 'claim' ELSE 'reconcile claim' END,
    kind || ' attempt ' || attempt_number, worker
FROM outbox_attempts WHERE claim_event_id IS NOT NULL
UNION ALL
SELECT move_event_id, operation_id, ended_at,
    CASE WHEN kind = 'dispatch' THEN 'dispatching' ELSE claimed_from END, moved_to, fencing_token,
    CASE WHEN kind = 'dispatch' THEN 'attempt result' ELSE 'lookup result' END,
    move_reason, worker
FROM outbox_attempts WHERE move_event_id IS NOT NULL"""
HISTORY_0016 = (
    HISTORY_0015
    + """
UNION ALL
SELECT submit_event_id, id, created_at, NULL, submitted_as, 0, 'submit', submit_reason, subject
FROM outbox_operations WHERE submit_event_id IS NOT NULL"""
)

COLUMNS = (
    ('submit_event_id', sa.BigInteger()),
    ('submitted_as', sa.String(32)),
    ('submit_reason', sa.Text()),
)


def upgrade() -> None:
    op.execute('DROP VIEW outbox_history')
    for name, type_ in COLUMNS:
        op.add_column('outbox_operations', sa.Column(name, type_, nullable=True))
    op.execute(f'CREATE VIEW outbox_history AS {HISTORY_0016}')


def downgrade() -> None:
    # Submits recorded on operation rows become event rows again before their columns go.
    op.execute(
        'INSERT INTO outbox_operation_events (id, operation_id, at, from_status, to_status, fencing_token, event,'
        ' reason, actor) SELECT submit_event_id, id, created_at, NULL, submitted_as, 0, \'submit\', submit_reason,'
        ' subject FROM outbox_operations WHERE submit_event_id IS NOT NULL'
    )
    op.execute('DROP VIEW outbox_history')
    for name, _ in reversed(COLUMNS):
        op.drop_column('outbox_operations', name)
    op.execute(f'CREATE VIEW outbox_history AS {HISTORY_0015}')
