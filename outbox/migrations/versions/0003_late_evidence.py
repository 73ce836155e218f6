"""late evidence: attempts.applied_at and the index of unapplied stale successes

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

UNAPPLIED_SUCCESS = "stale AND attempt_class = 'succeeded' AND applied_at IS NULL"


def upgrade() -> None:
    op.add_column('attempts', sa.Column('applied_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index('ix_attempts_unapplied_successes', 'attempts', ['id'], unique=False,
                    postgresql_where=sa.text(UNAPPLIED_SUCCESS), sqlite_where=sa.text(UNAPPLIED_SUCCESS))


def downgrade() -> None:
    op.drop_index('ix_attempts_unapplied_successes', table_name='attempts')
    with op.batch_alter_table('attempts') as batch:
        batch.drop_column('applied_at')
