"""A claim and its attempt's result recorded on the attempt row; ``outbox_history`` shows every event

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04

On PostgreSQL a claim wrote an attempt row and an event row, a finalize updated the attempt row and
wrote an event row: two of the nine row writes of an operation (and two of its four foreign-key
checks) were event rows that said again what the attempt row knows (bench/README.md, issue 35). From
this revision the claim and the move its result made are recorded on the attempt:

- ``outbox_attempts.claim_event_id`` (BIGINT), ``claimed_from`` (VARCHAR 32): the claim's event id,
  drawn from the events' own sequence (so the history keeps the order it was written in), and the
  status it claimed from;
- ``outbox_attempts.move_event_id`` (BIGINT), ``moved_to`` (VARCHAR 32), ``move_reason`` (TEXT): the
  move the attempt's result made, only when it moved the operation.

NULL on every existing row, and on rows of the SQLite driver, which still writes event rows. The view
``outbox_history`` is the whole history: the event rows and, spelled as event rows, the claims and
moves recorded on attempts. Every reader of an operation's history reads the view.

Added in place on both backends (nullable columns, a view): no table copy. The view depends on both
tables: a later migration that copies either (SQLite's batch mode), drops it, or drops or retypes a
column the view reads (on PostgreSQL: every column of the events, and the attempts' operation_id,
kind, attempt_number, fencing_token, worker, started_at, ended_at and the five above) drops the view
first and makes it again after.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

# The view as this revision makes it (outbox/ledger/history.py HISTORY_SELECT is the head's spelling).
HISTORY_SELECT = """
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

COLUMNS = (
    ('claim_event_id', sa.BigInteger()),
    ('claimed_from', sa.String(32)),
    ('move_event_id', sa.BigInteger()),
    ('moved_to', sa.String(32)),
    ('move_reason', sa.Text()),
)


def upgrade() -> None:
    for name, type_ in COLUMNS:
        op.add_column('outbox_attempts', sa.Column(name, type_, nullable=True))
    op.execute(f'CREATE VIEW outbox_history AS {HISTORY_SELECT}')


def downgrade() -> None:
    # Claims and moves recorded on attempts become event rows again before their columns go.
    op.execute(
        'INSERT INTO outbox_operation_events (id, operation_id, at, from_status, to_status, fencing_token, event,'
        ' reason, actor) SELECT id, operation_id, at, from_status, to_status, fencing_token, event, reason, actor'
        ' FROM outbox_history h WHERE NOT EXISTS (SELECT 1 FROM outbox_operation_events e WHERE e.id = h.id)'
    )
    op.execute('DROP VIEW outbox_history')
    for name, _ in reversed(COLUMNS):
        op.drop_column('outbox_attempts', name)
