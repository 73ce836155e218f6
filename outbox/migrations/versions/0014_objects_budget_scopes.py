"""Business objects and conversation budgets: two columns on outbox_operations, two small tables

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03

- ``outbox_operations.object_key`` (VARCHAR 255, nullable): the business object an intent touches,
  rendered at submit from its action's ``object`` template (outbox/ledger/objects.py). NULL for every
  existing row and for actions that declare none.
- ``outbox_operations.budget_scope`` (VARCHAR 255, nullable): the conversation whose budget the
  intent was charged to (outbox/ledger/budget_scopes.py).
- Partial indexes on (tenant, object_key) and (tenant, budget_scope), only for rows that carry one.
- ``outbox_object_holds``: which operation last passed the object gate, per (tenant, object_key).
- ``outbox_budget_scopes``: calls and amount spent per (tenant, scope, bucket).

Added in place on both backends (nullable columns, new tables): no table copy.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column('outbox_operations', sa.Column('object_key', sa.String(255), nullable=True))
    op.add_column('outbox_operations', sa.Column('budget_scope', sa.String(255), nullable=True))
    for column in ('object_key', 'budget_scope'):
        op.create_index(
            f'ix_outbox_operations_{"object" if column == "object_key" else column}',
            'outbox_operations',
            ['tenant', column],
            postgresql_where=sa.text(f'{column} IS NOT NULL'),
            sqlite_where=sa.text(f'{column} IS NOT NULL'),
        )
    op.create_table(
        'outbox_object_holds',
        sa.Column('tenant', sa.String(128), nullable=False),
        sa.Column('object_key', sa.String(255), nullable=False),
        sa.Column('operation_id', sa.String(36), nullable=False),
        sa.Column('taken_at', TS, nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'object_key', name='pk_outbox_object_holds'),
    )
    op.create_table(
        'outbox_budget_scopes',
        sa.Column('tenant', sa.String(128), nullable=False),
        sa.Column('scope', sa.String(255), nullable=False),
        sa.Column('bucket', sa.String(200), nullable=False),
        sa.Column('calls', sa.Integer(), nullable=False),
        sa.Column('amount_micros', sa.BigInteger(), nullable=False),
        sa.Column('opened_at', TS, nullable=False),
        sa.Column('updated_at', TS, nullable=False),
        sa.PrimaryKeyConstraint('tenant', 'scope', 'bucket', name='pk_outbox_budget_scopes'),
    )


def downgrade() -> None:
    op.drop_table('outbox_budget_scopes')
    op.drop_table('outbox_object_holds')
    op.drop_index('ix_outbox_operations_budget_scope', table_name='outbox_operations')
    op.drop_index('ix_outbox_operations_object', table_name='outbox_operations')
    op.drop_column('outbox_operations', 'budget_scope')
    op.drop_column('outbox_operations', 'object_key')
