"""The provider's webhook events, and the indexes that find an event's operation

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-08

- ``outbox_webhook_events``: one row per verified webhook event (outbox/ledger/webhook_models.py),
  unique per (target, verified_by, event_id) so a provider's retry of a delivered event (or a captured
  one posted under another path) changes nothing; partial indexes over the events no operation took:
  on ``received_at`` (the reconciliation report's "document without record"), on ``reference`` and on
  ``provider_key`` (an operation finds the events that came before it could take them).
- ``ix_outbox_operations_provider_key``: an event names its operation by the key the provider saw.
- ``ix_outbox_operations_result_reference`` (partial, where one is recorded): or by the provider's
  reference recorded on it.

New table and indexes, added in place on both backends: no table copy. (On a large PostgreSQL ledger
the two indexes are built under the migration's lock; build them beforehand with CREATE INDEX
CONCURRENTLY under these names to keep the upgrade short: the migration then finds them.)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
UNMATCHED = "disposition IN ('no_operation', 'ambiguous')"
DISPOSITIONS = "disposition IN ('settled', 'recorded', 'no_operation', 'ambiguous', 'ignored')"


def _has_index(name: str) -> bool:
    return name in {ix['name'] for ix in sa.inspect(op.get_bind()).get_indexes('outbox_operations')}


def upgrade() -> None:
    op.create_table(
        'outbox_webhook_events',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('target', sa.String(200), nullable=False),
        sa.Column('scope', sa.String(128), nullable=False),
        sa.Column('verified_by', sa.String(128), nullable=False),
        sa.Column('event_id', sa.String(255), nullable=False),
        sa.Column('event_type', sa.String(200), nullable=False),
        sa.Column('scheme', sa.String(16), nullable=False),
        sa.Column('received_at', TS, nullable=False),
        sa.Column('signed_at', TS, nullable=True),
        sa.Column('body_digest', sa.String(64), nullable=False),
        sa.Column('outcome', sa.String(16), nullable=True),
        sa.Column('action', sa.String(200), nullable=True),
        sa.Column('provider_key', sa.String(255), nullable=True),
        sa.Column('reference', sa.String(255), nullable=True),
        sa.Column('operation_id', sa.String(36), nullable=True),
        sa.Column('tenant', sa.String(128), nullable=True),
        sa.Column('disposition', sa.String(16), nullable=False),
        sa.Column('moved_to', sa.String(32), nullable=True),
        sa.Column('note', sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox_webhook_events')),
        sa.UniqueConstraint(
            'target', 'verified_by', 'event_id', name=op.f('uq_outbox_webhook_events_target_verified_by_event_id')
        ),
        sa.CheckConstraint(DISPOSITIONS, name=op.f('ck_outbox_webhook_events_disposition')),
    )
    op.create_index(op.f('ix_outbox_webhook_events_operation_id'), 'outbox_webhook_events', ['operation_id'])
    op.create_index(
        'ix_outbox_webhook_events_unmatched',
        'outbox_webhook_events',
        ['received_at'],
        postgresql_where=sa.text(UNMATCHED),
        sqlite_where=sa.text(UNMATCHED),
    )
    for column in ('reference', 'provider_key'):
        op.create_index(
            f'ix_outbox_webhook_events_unmatched_{column}',
            'outbox_webhook_events',
            [column],
            postgresql_where=sa.text(UNMATCHED),
            sqlite_where=sa.text(UNMATCHED),
        )
    if not _has_index('ix_outbox_operations_provider_key'):
        op.create_index('ix_outbox_operations_provider_key', 'outbox_operations', ['provider_key'])
    if not _has_index('ix_outbox_operations_result_reference'):
        op.create_index(
            'ix_outbox_operations_result_reference',
            'outbox_operations',
            ['result_reference'],
            postgresql_where=sa.text('result_reference IS NOT NULL'),
            sqlite_where=sa.text('result_reference IS NOT NULL'),
        )


def downgrade() -> None:
    op.drop_index('ix_outbox_operations_result_reference', table_name='outbox_operations')
    op.drop_index('ix_outbox_operations_provider_key', table_name='outbox_operations')
    op.drop_index('ix_outbox_webhook_events_unmatched_provider_key', table_name='outbox_webhook_events')
    op.drop_index('ix_outbox_webhook_events_unmatched_reference', table_name='outbox_webhook_events')
    op.drop_index('ix_outbox_webhook_events_unmatched', table_name='outbox_webhook_events')
    op.drop_index('ix_outbox_webhook_events_operation_id', table_name='outbox_webhook_events')
    op.drop_table('outbox_webhook_events')
