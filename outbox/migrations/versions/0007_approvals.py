"""approvals: a person's decision bound to an operation's args digest, policy version and expiry

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'approvals',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('operation_id', sa.String(length=36), nullable=False),
        sa.Column('tenant', sa.String(length=128), nullable=False),
        sa.Column('action', sa.String(length=200), nullable=False),
        sa.Column('args_digest', sa.String(length=64), nullable=False),
        sa.Column('requested_by', sa.String(length=255), nullable=False),
        sa.Column('policy_version', sa.String(length=64), nullable=False),
        sa.Column('decision', sa.String(length=16), nullable=False),
        sa.Column('approver', sa.String(length=255), nullable=False),
        sa.Column('note', sa.Text(), nullable=True),
        sa.Column('decided_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("decision IN ('approved', 'denied')", name=op.f('ck_approvals_decision')),
        sa.ForeignKeyConstraint(
            ['operation_id'], ['operations.id'], name=op.f('fk_approvals_operation_id_operations'), ondelete='CASCADE'
        ),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_approvals')),
    )
    op.create_index(op.f('ix_approvals_operation_id'), 'approvals', ['operation_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_approvals_operation_id'), table_name='approvals')
    op.drop_table('approvals')
