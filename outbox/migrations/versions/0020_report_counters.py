"""Retries charged to a conversation's budget, and the key uses the report counts

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-09

- ``outbox_budget_scopes.retry_billed`` (INTEGER, default 0): dispatch attempts beyond each call's
  first, charged to the conversation right before each leaves (outbox/ledger/budget_charges.py).
  Filled from the operations already charged to each scope (their attempts beyond the first), as the
  submit counted them until now.
- ``outbox_budget_charges``: one row per charged attempt, keyed by the attempt's id (a charge asked
  twice is made once).
- ``outbox_key_uses``: same-key replays and key conflicts per (tenant, action, minute)
  (outbox/ledger/key_uses.py), and an index on the minute (the report reads a window).

New tables and a column with a default, added in place on both backends: no table copy.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BIGID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.add_column(
        'outbox_budget_scopes', sa.Column('retry_billed', sa.Integer(), server_default=sa.text('0'), nullable=False)
    )
    # What the submit read until now (attempts beyond each call's first, per bucket: '*' for all).
    op.execute(
        """
        UPDATE outbox_budget_scopes SET retry_billed = (
            SELECT coalesce(sum(CASE WHEN o.attempt_count > 1 THEN o.attempt_count - 1 ELSE 0 END), 0)
            FROM outbox_operations o
            WHERE o.tenant = outbox_budget_scopes.tenant AND o.budget_scope = outbox_budget_scopes.scope
              AND (outbox_budget_scopes.bucket = '*' OR o.action = outbox_budget_scopes.bucket)
        )
        """
    )
    op.create_table(
        'outbox_budget_charges',
        sa.Column('attempt_id', BIGID, autoincrement=False, nullable=False),
        sa.Column('operation_id', sa.String(36), nullable=False),
        sa.Column('tenant', sa.String(128), nullable=False),
        sa.Column('scope', sa.String(255), nullable=False),
        sa.Column('charged_at', TS, nullable=False),
        sa.PrimaryKeyConstraint('attempt_id', name='pk_outbox_budget_charges'),
    )
    op.create_table(
        'outbox_key_uses',
        sa.Column('tenant', sa.String(128), nullable=False),
        sa.Column('action', sa.String(200), nullable=False),
        sa.Column('minute', TS, nullable=False),
        sa.Column('replays', sa.Integer(), nullable=False),
        sa.Column('conflicts', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'action', 'minute', name='pk_outbox_key_uses'),
    )
    op.create_index('ix_outbox_key_uses_minute', 'outbox_key_uses', ['minute'])


def downgrade() -> None:
    op.drop_index('ix_outbox_key_uses_minute', table_name='outbox_key_uses')
    op.drop_table('outbox_key_uses')
    op.drop_table('outbox_budget_charges')
    op.drop_column('outbox_budget_scopes', 'retry_billed')
