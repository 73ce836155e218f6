"""An operation records its action's version and the first request that left under its key

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-08

A retry was built again from the actions file at every attempt, so an actions file deployed while an
operation waited (another path, a ``query:``, ``decimal_args``) changed the request sent under the
same idempotency key. From this revision an operation records (outbox/ledger/request_record.py):

- ``action_version`` (VARCHAR 64): the version of its action's request-shaping definition at submit
  (outbox/actions/versions.py);
- ``request_version``, ``request_method`` (VARCHAR 16), ``request_path`` (TEXT),
  ``request_body`` (TEXT), ``request_digest`` (VARCHAR 64): the first request that left under its
  key, and the version it was built under; later attempts send exactly it.

NULL on every existing row: their later attempts are built from the actions file as before (the
version they were submitted under is not known). Added in place on both backends (nullable columns,
no default): no table copy, no rewrite of existing rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

COLUMNS = (
    ('action_version', sa.String(64)),
    ('request_version', sa.String(64)),
    ('request_method', sa.String(16)),
    ('request_path', sa.Text()),
    ('request_body', sa.Text()),
    ('request_digest', sa.String(64)),
)


def upgrade() -> None:
    for name, type_ in COLUMNS:
        op.add_column('outbox_operations', sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column('outbox_operations', name)
