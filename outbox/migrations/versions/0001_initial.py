"""initial ledger: operations, attempts, operation_events

Revision ID: 0001
Revises: 
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('operations',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=128), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=False),
    sa.Column('action', sa.String(length=200), nullable=False),
    sa.Column('args', sa.Text(), nullable=True),
    sa.Column('args_digest', sa.String(length=64), nullable=False),
    sa.Column('subject', sa.String(length=255), nullable=False),
    sa.Column('run_id', sa.String(length=255), nullable=True),
    sa.Column('tool_call_id', sa.String(length=255), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('lease_owner', sa.String(length=255), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('attempt_count', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=True),
    sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('result_reference', sa.String(length=255), nullable=True),
    sa.Column('result_digest', sa.String(length=64), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('error_class', sa.String(length=32), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('proven_absent_through', sa.Integer(), nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("error_class IS NULL OR error_class IN ('not_sent', 'not_processed', 'rejected', 'ambiguous', 'succeeded', 'pending')", name=op.f('ck_operations_error_class')),
    sa.CheckConstraint("status IN ('awaiting_approval', 'not_dispatched', 'dispatching', 'succeeded', 'committed_evidence_degraded', 'failed_before_commit', 'outcome_unknown', 'reconciliation_required', 'cancelled')", name=op.f('ck_operations_status')),
    sa.CheckConstraint('attempt_count >= 0 AND (max_attempts IS NULL OR max_attempts >= 1)', name=op.f('ck_operations_attempts')),
    sa.CheckConstraint('fencing_token >= 0', name=op.f('ck_operations_fencing_token')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_operations')),
    sa.UniqueConstraint('tenant', 'idempotency_key', name=op.f('uq_operations_tenant_idempotency_key'))
    )
    op.create_index('ix_operations_due', 'operations', ['next_attempt_at'], unique=False, postgresql_where=sa.text("status = 'not_dispatched'"), sqlite_where=sa.text("status = 'not_dispatched'"))
    op.create_index('ix_operations_leases', 'operations', ['lease_expires_at'], unique=False, postgresql_where=sa.text("status = 'dispatching'"), sqlite_where=sa.text("status = 'dispatching'"))
    op.create_index('ix_operations_status_updated', 'operations', ['status', 'updated_at'], unique=False)
    op.create_index('ix_operations_unknown', 'operations', ['next_attempt_at'], unique=False, postgresql_where=sa.text("status = 'outcome_unknown'"), sqlite_where=sa.text("status = 'outcome_unknown'"))
    op.create_table('attempts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('operation_id', sa.String(length=36), nullable=False),
    sa.Column('attempt_number', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('worker', sa.String(length=255), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('request_digest', sa.String(length=64), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('attempt_class', sa.String(length=32), nullable=False),
    sa.Column('provider_request_id', sa.String(length=255), nullable=True),
    sa.Column('provider_reference', sa.String(length=255), nullable=True),
    sa.Column('response_digest', sa.String(length=64), nullable=True),
    sa.Column('retry_after_s', sa.Float(), nullable=True),
    sa.Column('latency_s', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('stale', sa.Boolean(), nullable=False),
    sa.CheckConstraint("attempt_class IN ('not_sent', 'not_processed', 'rejected', 'ambiguous', 'succeeded', 'pending')", name=op.f('ck_attempts_attempt_class')),
    sa.CheckConstraint("kind IN ('dispatch', 'lookup')", name=op.f('ck_attempts_kind')),
    sa.ForeignKeyConstraint(['operation_id'], ['operations.id'], name=op.f('fk_attempts_operation_id_operations'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('operation_id', 'kind', 'attempt_number', name=op.f('uq_attempts_operation_id_kind_attempt_number'))
    )
    op.create_table('operation_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('operation_id', sa.String(length=36), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('from_status', sa.String(length=32), nullable=True),
    sa.Column('to_status', sa.String(length=32), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('event', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=255), nullable=False),
    sa.ForeignKeyConstraint(['operation_id'], ['operations.id'], name=op.f('fk_operation_events_operation_id_operations'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_operation_events'))
    )
    op.create_index(op.f('ix_operation_events_operation_id'), 'operation_events', ['operation_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_operation_events_operation_id'), table_name='operation_events')
    op.drop_table('operation_events')
    op.drop_table('attempts')
    op.drop_index('ix_operations_unknown', table_name='operations', postgresql_where=sa.text("status = 'outcome_unknown'"), sqlite_where=sa.text("status = 'outcome_unknown'"))
    op.drop_index('ix_operations_status_updated', table_name='operations')
    op.drop_index('ix_operations_leases', table_name='operations', postgresql_where=sa.text("status = 'dispatching'"), sqlite_where=sa.text("status = 'dispatching'"))
    op.drop_index('ix_operations_due', table_name='operations', postgresql_where=sa.text("status = 'not_dispatched'"), sqlite_where=sa.text("status = 'not_dispatched'"))
    op.drop_table('operations')
