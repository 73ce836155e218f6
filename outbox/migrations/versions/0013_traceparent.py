"""outbox_operations.traceparent: the W3C trace context an intent was submitted in

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03

``traceparent`` (TEXT, nullable): written at submit (the caller's trace, or the submit span's when
the producer traces: outbox/ledger/tracing.py); every later span of the operation (relay, claim,
attempts, lookups, settlement, handoff) continues it. NULL for every existing row and for intents
submitted without a trace. Added in place on both backends (a nullable column, no default).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('outbox_operations', sa.Column('traceparent', sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column('outbox_operations', 'traceparent')
