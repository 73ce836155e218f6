"""report_runs: reconciliation reports kept in the ledger, for the exporter, the API and the console

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'report_runs',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('since', sa.DateTime(timezone=True), nullable=False),
        sa.Column('complete', sa.Boolean(), nullable=False),
        sa.Column('discrepancies', sa.Integer(), nullable=False),
        sa.Column('duplicate_effects', sa.Integer(), nullable=False),
        sa.Column('by_tenant', sa.JSON(), nullable=False),
        sa.Column('health', sa.JSON(), nullable=False),
        sa.Column('findings', sa.JSON(), nullable=False),
        sa.Column('ran_by', sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_report_runs')),
    )
    op.create_index(op.f('ix_report_runs_finished_at'), 'report_runs', ['finished_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_report_runs_finished_at'), table_name='report_runs')
    op.drop_table('report_runs')
