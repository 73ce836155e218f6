"""What a request under a key was built under, when it was never recorded; which header carried its key

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-09

The request on record under a key (0017) was written only by a fenced finalize: a worker killed,
frozen past its lease or refused between its send and its finalize left nothing, and a retry was
judged against the version recorded at submit, which may be unknown (a producer without the
actions file) or the producer's, not the worker's (a rolling deploy). From this revision
(outbox/ledger/request_record.py):

- ``outbox_attempts.action_version`` (VARCHAR 64): the version of the action the worker held when
  it claimed the attempt (written by the claim): a retry with nothing on record builds its request
  only under the version of every earlier attempt that may have left;
- ``outbox_operations.request_key_header`` (VARCHAR 255): the header that carried the idempotency
  key of the request on record (lower case; empty: none): a resend under another header, or
  without one, would not be the request the provider holds under the key.

NULL on existing rows: an earlier attempt without a version counts as built under the version at
submit; a request on record without a header is sent again only under the version it was built
under. Added in place on both backends (nullable, no default): no table copy, no rewrite.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('outbox_attempts', sa.Column('action_version', sa.String(64), nullable=True))
    op.add_column('outbox_operations', sa.Column('request_key_header', sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column('outbox_operations', 'request_key_header')
    op.drop_column('outbox_attempts', 'action_version')
