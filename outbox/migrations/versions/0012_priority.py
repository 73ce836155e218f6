"""operations.priority and runs.priority; the fair claim's index

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04

- ``priority`` (SMALLINT NOT NULL DEFAULT 0, -100..100 checked at submit): the claim takes a
  tenant's higher priorities first. A run carries one for all its steps. Every existing row gets 0,
  today's order.
- ``ix_outbox_operations_fair_due`` on (tenant, priority DESC, next_attempt_at) for not_dispatched
  rows: the claim walks the tenants with work due and each tenant's due rows in claim order
  (outbox/ledger/drivers/pg_statements.py).

Both columns are added in place on both backends (SQLite adds a column with a constant default
without copying the table); no CHECK constraint, which SQLite could only add by copying it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

FAIR_DUE = 'ix_outbox_operations_fair_due'
NOT_DISPATCHED = "status = 'not_dispatched'"


def upgrade() -> None:
    for table in ('outbox_operations', 'outbox_runs'):
        op.add_column(table, sa.Column('priority', sa.SmallInteger(), server_default=sa.text('0'), nullable=False))
    op.create_index(
        FAIR_DUE, 'outbox_operations', ['tenant', sa.literal_column('priority').desc(), 'next_attempt_at'], unique=False,
        postgresql_where=sa.text(NOT_DISPATCHED), sqlite_where=sa.text(NOT_DISPATCHED),
    )


def downgrade() -> None:
    op.drop_index(FAIR_DUE, table_name='outbox_operations')
    for table in ('outbox_operations', 'outbox_runs'):
        op.drop_column(table, 'priority')
