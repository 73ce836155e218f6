"""handoffs and evidence

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('evidence',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('operation_id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=False),
    sa.Column('action', sa.String(length=200), nullable=False),
    sa.Column('args_digest', sa.String(length=64), nullable=False),
    sa.Column('provider_reference', sa.String(length=255), nullable=True),
    sa.Column('response_digest', sa.String(length=64), nullable=True),
    sa.Column('attempt_log_digest', sa.String(length=64), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evidence'))
    )
    op.create_index(op.f('ix_evidence_operation_id'), 'evidence', ['operation_id'], unique=False)
    op.create_table('handoffs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('operation_id', sa.String(length=36), nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('packet', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('resolution', sa.String(length=32), nullable=True),
    sa.Column('resolved_reference', sa.String(length=255), nullable=True),
    sa.Column('resolved_by', sa.String(length=255), nullable=True),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('note', sa.Text(), nullable=True),
    sa.CheckConstraint("resolution IS NULL OR resolution IN ('succeeded', 'not-executed', 'abandoned')", name=op.f('ck_handoffs_resolution')),
    sa.CheckConstraint("status IN ('open', 'resolved')", name=op.f('ck_handoffs_status')),
    sa.ForeignKeyConstraint(['operation_id'], ['operations.id'], name=op.f('fk_handoffs_operation_id_operations'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_handoffs'))
    )
    op.create_index('ix_handoffs_open', 'handoffs', ['opened_at'], unique=False, postgresql_where=sa.text("status = 'open'"), sqlite_where=sa.text("status = 'open'"))
    op.create_index(op.f('ix_handoffs_operation_id'), 'handoffs', ['operation_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_handoffs_operation_id'), table_name='handoffs')
    op.drop_index('ix_handoffs_open', table_name='handoffs', postgresql_where=sa.text("status = 'open'"), sqlite_where=sa.text("status = 'open'"))
    op.drop_table('handoffs')
    op.drop_index(op.f('ix_evidence_operation_id'), table_name='evidence')
    op.drop_table('evidence')
