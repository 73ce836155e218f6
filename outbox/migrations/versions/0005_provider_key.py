"""operations.provider_key: the key the provider sees, scoped by tenant, stored at submit

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Before this revision every request carried the bare idempotency_key, so two tenants with the same
business key shared one key at the provider (one effect for two intents). New intents store the
rendered key (outbox/provider_keys.py, default ``{tenant}:{idempotency_key}``). Rows written before
keep the key their requests already carried: they get ``provider_key = idempotency_key``, or a
lookup would ask for a key the provider has never seen and "not found" would be a lie.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN (not a batch table copy on SQLite: see 0004).
    op.add_column('operations', sa.Column('provider_key', sa.String(255), nullable=True))
    op.execute("UPDATE operations SET provider_key = idempotency_key")


def downgrade() -> None:
    op.drop_column('operations', 'provider_key')
