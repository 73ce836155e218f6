"""Handoffs that keep working: an owner, a next check, "retry as a new intent", and the abandoned state

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-09

- ``outbox_handoffs``: ``owner`` (VARCHAR 255: the identity that took the case, ``key:<id>`` or
  ``cli:<account>``) and ``taken_at``; ``next_check_at`` (when the reconciler asks the provider
  again; NULL: not re-checked) and ``checks_until`` (the provider's key retention from the first
  attempt); ``evidence_attempt_id`` (the attempt whose evidence resolved it); the resolutions
  ``retry-as-new-intent`` and ``failed-at-provider``; a partial index on ``next_check_at`` over the
  open cases that have one (the re-checks due).
- ``outbox_operations``: ``retry_of`` / ``retried_as`` (VARCHAR 36), the two ends of a "retry as a
  new intent"; the state ``abandoned`` (a person closed the case without knowing: before this
  revision such an operation stayed ``reconciliation_required`` with its handoff resolved).

Existing operations that a person abandoned keep their state: nothing here guesses which
``reconciliation_required`` rows with a resolved handoff were abandoned and which wait for a new one
(a contradiction reviewed by a person re-opens a handoff). Existing open handoffs get no next check:
they were handed over before re-checks existed, and a person owns the decision already.

The columns are added in place on both backends. SQLite cannot alter a CHECK constraint: the two
tables are rebuilt the way SQLite documents (as revision 0010 did), with foreign keys off for the
migration (outbox/migrate.py), and the view ``outbox_history``, which reads the operations table,
is dropped around the rebuild and made again exactly as it was. Every row keeps its state.
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
OLD_STATUSES = (
    'awaiting_approval', 'not_dispatched', 'dispatching', 'succeeded', 'committed_evidence_degraded',
    'failed_before_commit', 'outcome_unknown', 'reconciliation_required', 'cancelled', 'accepted',
    'failed_at_provider',
)
STATUSES = OLD_STATUSES + ('abandoned',)
OLD_RESOLUTIONS = ('succeeded', 'not-executed', 'abandoned')
RESOLUTIONS = OLD_RESOLUTIONS + ('retry-as-new-intent', 'failed-at-provider')
CHECKS_INDEX = 'ix_outbox_handoffs_checks'
HANDOFF_CHECKS = "status = 'open' AND next_check_at IS NOT NULL"
HANDOFF_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ('owner', sa.String(255)),
    ('taken_at', TS),
    ('next_check_at', TS),
    ('checks_until', TS),
    ('evidence_attempt_id', sa.BigInteger()),
)
OPERATION_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (('retry_of', sa.String(36)), ('retried_as', sa.String(36)))


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _checks(statuses: tuple[str, ...], resolutions: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    return {
        'outbox_operations': ('ck_outbox_operations_status', f"status IN ({_in(statuses)})"),
        'outbox_handoffs': (
            'ck_outbox_handoffs_resolution',
            f"resolution IS NULL OR resolution IN ({_in(resolutions)})",
        ),
    }


def _replace_check(sql: str, name: str, cond: str) -> str:
    # The condition ends at the parenthesis that closes CHECK (; these hold one level of parentheses.
    pattern = re.compile(rf"CONSTRAINT {name} CHECK \((?:[^()]|\([^()]*\))*\)")
    new, n = pattern.subn(f"CONSTRAINT {name} CHECK ({cond})", sql)
    assert n == 1, f"{name} not found in {sql}"
    return new


def _sqlite_rebuild(table: str, name: str, cond: str) -> None:
    """SQLite's documented way to change a table's constraints: a new table, the rows copied."""
    bind = op.get_bind()
    create = bind.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
    ).scalar_one()
    indexes = [
        row[0]
        for row in bind.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL", (table,)
        )
    ]
    columns = ", ".join(f'"{row[1]}"' for row in bind.exec_driver_sql(f"PRAGMA table_info({table})"))
    tmp = f"_new_{table}"
    new = _replace_check(create, name, cond)
    bind.exec_driver_sql(re.sub(rf"^CREATE TABLE \"?{table}\"?", f"CREATE TABLE {tmp}", new, count=1))
    bind.exec_driver_sql(f"INSERT INTO {tmp} ({columns}) SELECT {columns} FROM {table}")
    bind.exec_driver_sql(f"DROP TABLE {table}")
    bind.exec_driver_sql(f"ALTER TABLE {tmp} RENAME TO {table}")
    for sql in indexes:
        bind.exec_driver_sql(sql)


def _set_checks(statuses: tuple[str, ...], resolutions: tuple[str, ...]) -> None:
    checks = _checks(statuses, resolutions)
    bind = op.get_bind()
    if bind.dialect.name != 'sqlite':
        for table, (name, cond) in checks.items():
            op.drop_constraint(op.f(name), table, type_='check')
            op.create_check_constraint(op.f(name), table, cond)
        return
    # A view that reads a table being renamed would fail SQLite's check of the schema: made again after.
    views = bind.exec_driver_sql("SELECT name, sql FROM sqlite_master WHERE type = 'view'").all()
    for view, _ in views:
        bind.exec_driver_sql(f'DROP VIEW "{view}"')
    for table, (name, cond) in checks.items():
        _sqlite_rebuild(table, name, cond)
    for _, sql in views:
        bind.exec_driver_sql(sql)


def upgrade() -> None:
    for name, type_ in OPERATION_COLUMNS:
        op.add_column('outbox_operations', sa.Column(name, type_, nullable=True))
    for name, type_ in HANDOFF_COLUMNS:
        op.add_column('outbox_handoffs', sa.Column(name, type_, nullable=True))
    _set_checks(STATUSES, RESOLUTIONS)
    op.create_index(
        CHECKS_INDEX, 'outbox_handoffs', ['next_check_at'], unique=False,
        postgresql_where=sa.text(HANDOFF_CHECKS), sqlite_where=sa.text(HANDOFF_CHECKS),
    )


def downgrade() -> None:
    bind = op.get_bind()
    abandoned = bind.exec_driver_sql("SELECT count(*) FROM outbox_operations WHERE status = 'abandoned'").scalar_one()
    resolved = bind.exec_driver_sql(
        "SELECT count(*) FROM outbox_handoffs WHERE resolution IN ('retry-as-new-intent', 'failed-at-provider')"
    ).scalar_one()
    if abandoned or resolved:
        raise RuntimeError(
            f"{abandoned} operation(s) are abandoned and {resolved} handoff(s) were resolved in ways revision 0021 "
            "cannot hold: the downgrade would lose what a person decided"
        )
    op.drop_index(CHECKS_INDEX, table_name='outbox_handoffs')
    _set_checks(OLD_STATUSES, OLD_RESOLUTIONS)
    for name, _ in reversed(HANDOFF_COLUMNS):
        op.drop_column('outbox_handoffs', name)
    for name, _ in reversed(OPERATION_COLUMNS):
        op.drop_column('outbox_operations', name)
