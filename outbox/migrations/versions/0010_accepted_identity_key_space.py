"""accepted and failed_at_provider states; who submitted (operations.submitted_by); run keys apart (key_space)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

- Two states: ``accepted`` (the provider took the request and has not finished it: a 202, or a
  status in the action's ``lookup.pending``) and ``failed_at_provider`` (it then reported it
  failed); one attempt class, ``accepted``. The status CHECK, both class CHECKs and the
  reconciler's partial index (it now claims accepted rows too) change with them.
- ``submitted_by`` (operations and runs): the identity that submitted (``key:<id>`` over the API), which separation of
  duties compares. Rows submitted before this revision have none: for them an approval falls back
  to comparing the subject, which for API submits was ``api:key-<id>``; that is copied here.
- ``key_space``: 'run' for the steps and compensations of runs, 'intent' for everything else, so
  that a plain intent can never be adopted as a run's step, nor a step answer a plain submit.

SQLite cannot alter a CHECK constraint: the two tables are rebuilt the way SQLite documents
(create the new table, copy, drop, rename, recreate the indexes), with foreign keys off for the
migration (outbox/migrate.py), so no attempt or event row is cascaded away. Every row keeps its
state: a migration of a ledger with work in flight loses nothing (tests/integration/ledger/test_upgrade.py).
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

OLD_STATUSES = (
    'awaiting_approval', 'not_dispatched', 'dispatching', 'succeeded', 'committed_evidence_degraded',
    'failed_before_commit', 'outcome_unknown', 'reconciliation_required', 'cancelled',
)
STATUSES = OLD_STATUSES + ('accepted', 'failed_at_provider')
OLD_CLASSES = ('not_sent', 'not_processed', 'rejected', 'ambiguous', 'succeeded', 'pending')
CLASSES = OLD_CLASSES + ('accepted',)
OLD_UNKNOWN_DUE = "status = 'outcome_unknown'"
UNKNOWN_DUE = "status IN ('accepted', 'outcome_unknown')"


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _checks(statuses: tuple[str, ...], classes: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    return {
        'operations': (
            'ck_operations_status',
            f"status IN ({_in(statuses)})",
        ),
        'operations_error_class': (
            'ck_operations_error_class',
            f"error_class IS NULL OR error_class IN ({_in(classes)})",
        ),
        'attempts': ('ck_attempts_attempt_class', f"attempt_class IN ({_in(classes)})"),
    }


def _set_checks(statuses: tuple[str, ...], classes: tuple[str, ...], key_space: bool) -> None:
    checks = _checks(statuses, classes)
    if op.get_bind().dialect.name == 'sqlite':
        def edit_operations(sql: str) -> str:
            for name, cond in (checks['operations'], checks['operations_error_class']):
                sql = _replace_check(sql, name, cond)
            sql = re.sub(r",\s*CONSTRAINT ck_operations_key_space CHECK \((?:[^()]|\([^()]*\))*\)", "", sql)
            if key_space:
                sql = sql.rstrip().removesuffix(')') + ", \n\tCONSTRAINT ck_operations_key_space CHECK (key_space IN ('intent', 'run'))\n)"
            return sql

        _sqlite_rebuild('operations', edit_operations)
        _sqlite_rebuild('attempts', lambda sql: _replace_check(sql, *checks['attempts']))
        return
    for table, (name, cond) in (
        ('operations', checks['operations']),
        ('operations', checks['operations_error_class']),
        ('attempts', checks['attempts']),
    ):
        op.drop_constraint(op.f(name), table, type_='check')
        op.create_check_constraint(op.f(name), table, cond)
    if key_space:
        op.create_check_constraint(op.f('ck_operations_key_space'), 'operations', "key_space IN ('intent', 'run')")


def _replace_check(sql: str, name: str, cond: str) -> str:
    # The constraint's condition ends at the parenthesis that closes CHECK (; the conditions here
    # hold one level of parentheses at most ("x IS NULL OR x IN (...)").
    pattern = re.compile(rf"CONSTRAINT {name} CHECK \((?:[^()]|\([^()]*\))*\)")
    new, n = pattern.subn(f"CONSTRAINT {name} CHECK ({cond})", sql)
    assert n == 1, f"{name} not found in {sql}"
    return new


def _sqlite_rebuild(table: str, edit) -> None:  # type: ignore[no-untyped-def]
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
    columns = ", ".join(row[1] for row in bind.exec_driver_sql(f"PRAGMA table_info({table})"))
    tmp = f"_new_{table}"
    new = edit(create)
    bind.exec_driver_sql(re.sub(rf"^CREATE TABLE \"?{table}\"?", f"CREATE TABLE {tmp}", new, count=1))
    bind.exec_driver_sql(f"INSERT INTO {tmp} ({columns}) SELECT {columns} FROM {table}")
    bind.exec_driver_sql(f"DROP TABLE {table}")
    bind.exec_driver_sql(f"ALTER TABLE {tmp} RENAME TO {table}")
    for sql in indexes:
        bind.exec_driver_sql(sql)


def _unknown_index(where: str) -> None:
    op.drop_index('ix_operations_unknown', table_name='operations')
    op.create_index('ix_operations_unknown', 'operations', ['next_attempt_at'], unique=False,
                    postgresql_where=sa.text(where), sqlite_where=sa.text(where))


def upgrade() -> None:
    op.add_column('operations', sa.Column('submitted_by', sa.String(255), nullable=True))
    op.add_column('runs', sa.Column('submitted_by', sa.String(255), nullable=True))
    op.add_column('operations', sa.Column('key_space', sa.String(8), server_default=sa.text("'intent'"),
                                          nullable=False))
    _set_checks(STATUSES, CLASSES, key_space=True)
    _unknown_index(UNKNOWN_DUE)
    # An API submit's default subject named its key: the identity it had.
    for table in ('operations', 'runs'):
        op.execute(
            f"UPDATE {table} SET submitted_by = 'key:' || substr(subject, 9)"
            " WHERE subject LIKE 'api:key-%' AND submitted_by IS NULL"
        )
    # Steps and compensations: operations whose run_id names a run of this ledger, of the same tenant.
    op.execute(
        "UPDATE operations SET key_space = 'run' WHERE run_id IS NOT NULL AND EXISTS"
        " (SELECT 1 FROM runs WHERE runs.id = operations.run_id AND runs.tenant = operations.tenant)"
    )


def downgrade() -> None:
    bind = op.get_bind()
    new_states = bind.exec_driver_sql(
        "SELECT count(*) FROM operations WHERE status IN ('accepted', 'failed_at_provider')"
    ).scalar_one()
    if new_states:
        raise RuntimeError(
            f"{new_states} operation(s) are accepted or failed_at_provider, which revision 0009 cannot hold: "
            "settle them first"
        )
    bind.exec_driver_sql("UPDATE attempts SET attempt_class = 'succeeded' WHERE attempt_class = 'accepted'")
    bind.exec_driver_sql("UPDATE operations SET error_class = 'succeeded' WHERE error_class = 'accepted'")
    _unknown_index(OLD_UNKNOWN_DUE)
    if bind.dialect.name != 'sqlite':
        op.drop_constraint(op.f('ck_operations_key_space'), 'operations', type_='check')
    _set_checks(OLD_STATUSES, OLD_CLASSES, key_space=False)
    op.drop_column('operations', 'key_space')
    op.drop_column('operations', 'submitted_by')
    op.drop_column('runs', 'submitted_by')
