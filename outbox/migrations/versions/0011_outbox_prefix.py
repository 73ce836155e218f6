"""every table, index, constraint and sequence of the ledger named outbox_...

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03

The ledger lives in the application's own database, beside the application's tables: an
application with a ``runs`` or ``approvals`` table of its own could not install it. Every object
the ledger creates now carries the prefix: ``operations`` becomes ``outbox_operations``, its
indexes and constraints follow their table (``ix_outbox_operations_due``,
``fk_outbox_attempts_operation_id_outbox_operations``), and on PostgreSQL so do the sequences of the
serial ids (``outbox_attempts_id_seq``). The version table already had its own name.

Only names change: every row stays as it is, with its id, state, lease and token, so a ledger with
work in flight (leased, parked unknown, waiting for a person or an approval, a run between two
steps) upgrades and settles (tests/integration/ledger/test_upgrade.py). Stop the workers, migrate, start
the new ones, as for every migration: a process of the previous release names the old tables.

PostgreSQL renames in place (one transaction; the renamed sequences stay the columns' defaults, which
refer to them by identity). SQLite cannot rename a constraint, whose name is part of its table's
CREATE statement: each table is rebuilt the way SQLite documents (create it under the new name
with the constraints renamed, copy the rows, drop the old one, create its indexes under their new
names), with foreign keys off for the migration (outbox/migrate.py), so no row is cascaded away.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

# models.PREFIX as of this revision: a migration says what it did once, whatever the models say later.
PREFIX = 'outbox_'
# Parents first: a rebuilt child's REFERENCES names a table that already exists.
TABLES = (
    'operations', 'attempts', 'operation_events', 'handoffs', 'evidence', 'approvals', 'api_keys', 'runs',
    'report_runs',
)
# Every index and named constraint at revision 0010, by table.
INDEXES = {
    'operations': ('ix_operations_due', 'ix_operations_leases', 'ix_operations_status_updated', 'ix_operations_unknown'),
    'attempts': ('ix_attempts_unapplied_successes',),
    'operation_events': ('ix_operation_events_operation_id',),
    'handoffs': ('ix_handoffs_open', 'ix_handoffs_operation_id'),
    'evidence': ('ix_evidence_operation_id',),
    'approvals': ('ix_approvals_operation_id',),
    'api_keys': (),
    'runs': ('ix_runs_active',),
    'report_runs': ('ix_report_runs_finished_at',),
}
CONSTRAINTS = {
    'operations': (
        'pk_operations', 'uq_operations_tenant_idempotency_key', 'ck_operations_attempts',
        'ck_operations_error_class', 'ck_operations_fencing_token', 'ck_operations_key_space', 'ck_operations_status',
    ),
    'attempts': (
        'pk_attempts', 'uq_attempts_operation_id_kind_attempt_number', 'ck_attempts_attempt_class',
        'ck_attempts_kind', 'fk_attempts_operation_id_operations',
    ),
    'operation_events': ('pk_operation_events', 'fk_operation_events_operation_id_operations'),
    'handoffs': ('pk_handoffs', 'ck_handoffs_resolution', 'ck_handoffs_status', 'fk_handoffs_operation_id_operations'),
    'evidence': ('pk_evidence',),
    'approvals': ('pk_approvals', 'ck_approvals_decision', 'fk_approvals_operation_id_operations'),
    'api_keys': ('pk_api_keys', 'uq_api_keys_key_hash'),
    'runs': ('pk_runs', 'uq_runs_tenant_run_key', 'ck_runs_max_attempts', 'ck_runs_status'),
    'report_runs': ('pk_report_runs',),
}
# PostgreSQL's sequences of the serial (BIGSERIAL) ids; operations and runs have string ids.
SERIAL = ('attempts', 'operation_events', 'handoffs', 'evidence', 'approvals', 'api_keys', 'report_runs')


def _objects() -> Iterator[tuple[str, str, str]]:
    """(kind, table, name at revision 0010): each table before its indexes and constraints."""
    for table in TABLES:
        yield 'table', table, table
        yield from (('index', table, name) for name in INDEXES[table])
        yield from (('constraint', table, name) for name in CONSTRAINTS[table])
        if table in SERIAL:
            yield 'sequence', table, f'{table}_id_seq'


def _prefixed(name: str) -> str:
    """A table's or sequence's name prefixed; an index's or constraint's (``kind_table_...``) after
    its kind, and a foreign key's table it refers to as well."""
    if not re.match(r'(ix|uq|pk|fk|ck)_', name):
        return PREFIX + name
    new = name[:3] + PREFIX + name[3:]
    return new.removesuffix('_operations') + f'_{PREFIX}operations' if name.startswith('fk_') else new


def _as_was(name: str) -> str:
    return name


def upgrade() -> None:
    _rename(_as_was, _prefixed)


def downgrade() -> None:
    _rename(_prefixed, _as_was)


def _rename(now: Callable[[str], str], to: Callable[[str], str]) -> None:
    if op.get_bind().dialect.name == 'sqlite':
        _sqlite_rename(now, to)
        return
    statements = {
        'table': 'ALTER TABLE {now} RENAME TO {to}',
        'index': 'ALTER INDEX {now} RENAME TO {to}',
        # A primary key's or unique constraint's index takes the constraint's new name with it.
        'constraint': 'ALTER TABLE {table} RENAME CONSTRAINT {now} TO {to}',
        'sequence': 'ALTER SEQUENCE {now} RENAME TO {to}',
    }
    for kind, table, name in _objects():
        op.execute(statements[kind].format(table=to(table), now=now(name), to=to(name)))


def _sqlite_rename(now: Callable[[str], str], to: Callable[[str], str]) -> None:
    bind = op.get_bind()
    names = {now(name): to(name) for _, _, name in _objects()}

    def swap(sql: str, pattern: str) -> str:
        """Every group of ``pattern`` in ``sql`` (a name, perhaps quoted) replaced by its new name."""

        def one(m: re.Match[str]) -> str:
            out, at = m.group(0), m.start(0)
            for g in reversed(range(1, (m.re.groups or 0) + 1)):
                start, end = m.span(g)
                out = out[: start - at] + names[m.group(g).strip('"')] + out[end - at :]
            return out

        return re.sub(pattern, one, sql)

    name = r'("?\w+"?)'
    indexes: list[str] = []
    for table in TABLES:
        old, new = now(table), to(table)
        create = bind.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (old,)
        ).scalar_one()
        indexes += [
            row[0]
            for row in bind.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL", (old,)
            )
        ]
        columns = ', '.join(row[1] for row in bind.exec_driver_sql(f'PRAGMA table_info({old})'))
        for pattern in (rf'^CREATE TABLE {name}', rf'CONSTRAINT {name}', rf'REFERENCES {name}'):
            create = swap(create, pattern)
        bind.exec_driver_sql(create)
        bind.exec_driver_sql(f'INSERT INTO {new} ({columns}) SELECT {columns} FROM {old}')
        bind.exec_driver_sql(f'DROP TABLE {old}')
    for sql in indexes:
        bind.exec_driver_sql(swap(sql, rf'^CREATE (?:UNIQUE )?INDEX {name} ON {name}'))
