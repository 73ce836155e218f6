"""runs: ordered step tables with compensation and a task-level budget (issue 18)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

STATUSES = "'running', 'compensating', 'succeeded', 'failed', 'compensated', 'cancelled', 'needs_person', 'resolved'"
ACTIVE = "status IN ('compensating', 'running')"


def upgrade() -> None:
    op.create_table(
        'runs',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('tenant', sa.String(length=128), nullable=False),
        sa.Column('run_key', sa.String(length=255), nullable=False),
        sa.Column('subject', sa.String(length=255), nullable=False),
        sa.Column('status', sa.String(length=24), nullable=False),
        sa.Column('steps', sa.Text(), nullable=True),
        sa.Column('spec_digest', sa.String(length=64), nullable=False),
        sa.Column('max_attempts', sa.Integer(), nullable=True),
        sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('current_op_id', sa.String(length=36), nullable=True),
        sa.Column('holding_step', sa.String(length=64), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('cancel_requested', sa.Boolean(), nullable=False),
        sa.Column('compensate_requested', sa.Boolean(), nullable=False),
        sa.Column('history', sa.JSON(), nullable=False),
        sa.Column('resolved_by', sa.String(length=255), nullable=True),
        sa.Column('note', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('purged_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(f"status IN ({STATUSES})", name=op.f('ck_runs_status')),
        sa.CheckConstraint('max_attempts IS NULL OR max_attempts >= 1', name=op.f('ck_runs_max_attempts')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
        sa.UniqueConstraint('tenant', 'run_key', name=op.f('uq_runs_tenant_run_key')),
    )
    op.create_index(
        'ix_runs_active',
        'runs',
        ['updated_at'],
        unique=False,
        postgresql_where=sa.text(ACTIVE),
        sqlite_where=sa.text(ACTIVE),
    )


def downgrade() -> None:
    op.drop_index('ix_runs_active', table_name='runs')
    op.drop_table('runs')
