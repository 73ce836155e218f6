"""An attempt's finalize rewrites its row in place (HOT): the late-success index keyed off what a finalize changes

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06

A finalize writes an attempt's result into the row its claim inserted (class, status code,
references, digests, the move). PostgreSQL updates a row in place, on its own page and without a
new entry in any index (a heap-only tuple), only if no column an index reads changed and the page
has room. ``ix_outbox_attempts_unapplied_successes`` (0003) read ``attempt_class`` in its
condition, so every finalize (``pending`` -> its class) wrote a new entry in each index of the
table, and the table's pages were filled to the last byte by the claims' inserts.

- The index's condition is now ``stale AND applied_at IS NULL``: a finalize of a current attempt
  changes neither (``stale`` stays false), so it can be HOT; the sweep's query
  (``models.UNAPPLIED_SUCCESS``, which adds ``attempt_class = 'succeeded'``) implies the new
  condition and still reads the index. The index now also holds stale attempts that did not
  succeed (a zombie's late failure or timeout: rare, and never applied).
- PostgreSQL: ``outbox_attempts`` keeps a tenth of each page free (``fillfactor = 90``) for the
  finalizes of the rows the claims put there. Applies to pages written from now on.

SQLite has no page fill setting; its index is remade with the same condition.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None

INDEX = 'ix_outbox_attempts_unapplied_successes'
OLD_CONDITION = "stale AND attempt_class = 'succeeded' AND applied_at IS NULL"
NEW_CONDITION = "stale AND applied_at IS NULL"
FILLFACTOR = 90  # models.ATTEMPTS_FILLFACTOR (a new ledger gets it from the models)


def _index(condition: str) -> None:
    op.create_index(INDEX, 'outbox_attempts', ['id'], unique=False,
                    postgresql_where=sa.text(condition), sqlite_where=sa.text(condition))


def upgrade() -> None:
    op.drop_index(INDEX, table_name='outbox_attempts')
    _index(NEW_CONDITION)
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(f'ALTER TABLE outbox_attempts SET (fillfactor = {FILLFACTOR})')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE outbox_attempts RESET (fillfactor)')
    op.drop_index(INDEX, table_name='outbox_attempts')
    _index(OLD_CONDITION)
