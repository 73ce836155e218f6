"""operations.provider_key: the key the provider sees, scoped by tenant, stored at submit

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Before this revision every request carried the bare idempotency_key, so two tenants with the same
business key shared one key at the provider (one effect for two intents). New intents store the
rendered key (outbox/provider_keys.py, default ``{tenant}:{idempotency_key}``). Rows written before
whose requests may already have gone out keep the key those requests carried (``provider_key =
idempotency_key``), or a lookup would ask for a key the provider has never seen and "not found"
would be a lie. Rows never sent (no dispatch attempt) get the tenant-scoped default, so two tenants'
queued ``refund-1`` do not still collide after the upgrade.

Run it with every worker stopped (as every migration here): a worker of the previous release
ignores provider_key and would send the bare key for an operation whose lookups now use the new one.
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN (not a batch table copy on SQLite: see 0004).
    op.add_column('operations', sa.Column('provider_key', sa.String(255), nullable=True))
    conn = op.get_bind()
    never_sent = conn.execute(
        sa.text(
            "SELECT id, tenant, idempotency_key FROM operations o WHERE NOT EXISTS "
            "(SELECT 1 FROM attempts a WHERE a.operation_id = o.id AND a.kind = 'dispatch')"
        )
    ).all()
    for row in never_sent:
        conn.execute(
            sa.text("UPDATE operations SET provider_key = :key WHERE id = :id"),
            {"key": _default_key(row.tenant, row.idempotency_key), "id": row.id},
        )
    op.execute("UPDATE operations SET provider_key = idempotency_key WHERE provider_key IS NULL")


def _default_key(tenant: str, key: str) -> str:
    """outbox.provider_keys.DEFAULT_RULE as of this revision (frozen here: history must not move)."""
    rendered = tenant.replace("%", "%25").replace(":", "%3A") + ":" + key
    return rendered if len(rendered) <= 255 else "h:" + hashlib.sha256(rendered.encode()).hexdigest()[:253]


def downgrade() -> None:
    op.drop_column('operations', 'provider_key')
