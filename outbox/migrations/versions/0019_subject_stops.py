"""Authority re-checked when work continues: subjects' emergency stops, how a key was revoked, who approved

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-09

- ``outbox_subject_stops``: one row per (tenant, subject) an operator stopped (outbox/ledger/stop_models.py):
  who, when, why. Its unsent intents are held and new ones refused until the row is deleted (resume).
- ``outbox_api_keys.revoked_by`` (VARCHAR 255) and ``revoke_cancels_queued`` (BOOLEAN, default false):
  who revoked a key, and whether its intents that had not left are cancelled (true) or handed to a
  person (false) at their next claim.
- ``outbox_approvals.approver_identity`` (VARCHAR 255): the key that approved (``key:<id>``); an
  approval given with a key revoked since no longer counts at the send.

A new table and nullable (or defaulted) columns, added in place on both backends: no table copy.
Keys revoked before this revision keep revoked_by NULL and hand their queued intents to a person.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'outbox_subject_stops',
        sa.Column('tenant', sa.String(128), nullable=False),
        sa.Column('subject', sa.String(255), nullable=False),
        sa.Column('stopped_by', sa.String(255), nullable=False),
        sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('tenant', 'subject', name=op.f('pk_outbox_subject_stops')),
    )
    op.add_column('outbox_api_keys', sa.Column('revoked_by', sa.String(255), nullable=True))
    op.add_column(
        'outbox_api_keys',
        sa.Column('revoke_cancels_queued', sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column('outbox_approvals', sa.Column('approver_identity', sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column('outbox_approvals', 'approver_identity')
    op.drop_column('outbox_api_keys', 'revoke_cancels_queued')
    op.drop_column('outbox_api_keys', 'revoked_by')
    op.drop_table('outbox_subject_stops')
