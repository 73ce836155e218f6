"""The alembic-migrated schema is exactly what the models declare, on both backends."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

from outbox import migrate
from outbox.ledger.db import make_engine
from outbox.ledger.models import ATTEMPTS, CLASS_VALUES, OPERATIONS, PREFIX, STATUS_VALUES, Base
from outbox.ledger.states import AttemptClass, Status
from tests.conftest import scratch_pg_database


def test_migrated_schema_matches_the_models(ledger):
    with ledger.engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"version_table": migrate.VERSION_TABLE, "compare_type": True, "compare_server_default": True}
        )
        diffs = compare_metadata(ctx, Base.metadata)
    # Alembic does not compare CHECK constraints at all (checked separately below) and reports
    # nothing it cannot reflect; every difference it does report is a real drift.
    assert diffs == [], "\n".join(map(repr, diffs))


def test_migration_is_at_head(ledger):
    assert migrate.current_revision(ledger.engine) == migrate.head_revision()


def _checks(ledger, table):
    return {c["name"]: re.sub(r"\s+", " ", c["sqltext"]) for c in inspect(ledger.engine).get_check_constraints(table)}


def test_status_check_constraint_matches_the_enum(ledger):
    # compare_metadata ignores CHECK constraints; a status added to the enum but not migrated would
    # only fail at run time, when the first operation tries to enter it.
    sql = _checks(ledger, OPERATIONS)[f"ck_{OPERATIONS}_status"]
    assert sorted(re.findall(r"'([a-z_]+)'", sql)) == sorted(s.value for s in Status)
    assert sorted(re.findall(r"'([a-z_]+)'", STATUS_VALUES)) == sorted(s.value for s in Status)


def test_attempt_class_check_constraints_match_the_enum(ledger):
    expected = sorted(c.value for c in AttemptClass)
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(ledger, ATTEMPTS)[f"ck_{ATTEMPTS}_attempt_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(ledger, OPERATIONS)[f"ck_{OPERATIONS}_error_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", CLASS_VALUES)) == expected


def test_every_model_check_constraint_exists_in_the_database(ledger):
    for table in Base.metadata.sorted_tables:
        declared = {c.name for c in table.constraints if c.__class__.__name__ == "CheckConstraint"}
        assert declared <= set(_checks(ledger, table.name)), table.name


def test_partial_indexes_are_partial(ledger):
    # The due/lease/unknown indexes stay small only if their WHERE clause survived the migration.
    indexes = {i["name"]: i for i in inspect(ledger.engine).get_indexes(OPERATIONS)}
    for name in (f"ix_{OPERATIONS}_due", f"ix_{OPERATIONS}_leases", f"ix_{OPERATIONS}_unknown"):
        assert name in indexes
        where = indexes[name].get("dialect_options", {}).get(f"{ledger.engine.dialect.name}_where")
        assert where is not None and "status" in str(where), (name, indexes[name])


def test_migrate_twice_is_a_no_op(ledger):
    before = migrate.current_revision(ledger.engine)
    migrate.upgrade(ledger.engine)
    assert migrate.current_revision(ledger.engine) == before == migrate.head_revision()


@pytest.fixture(params=["sqlite", "postgres"])
def fresh(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[bool], Engine]]:
    """Empty databases of one backend, made on demand: ``fresh(True)`` migrated to head,
    ``fresh(False)`` created straight from the models (``create_all``)."""
    engines: list[Engine] = []
    with ExitStack() as stack:

        def make(migrated: bool) -> Engine:
            name = f"{'migrated' if migrated else 'models'}_{uuid.uuid4().hex[:8]}"
            if request.param == "sqlite":
                url = f"sqlite:///{tmp_path / name}.db"
            else:
                url = stack.enter_context(scratch_pg_database(f"outbox_test_{name}", revision="base"))
            engine = make_engine(url)
            engines.append(engine)
            if migrated:
                migrate.upgrade(engine)
            else:
                Base.metadata.create_all(engine)
            return engine

        try:
            yield make
        finally:
            for engine in engines:
                engine.dispose()


def _names(engine: Engine) -> dict[str, Any]:
    """Every name the ledger's schema holds, by table: its primary key, foreign keys (and the table
    each refers to), unique and CHECK constraints, indexes (and their columns); the sequences."""
    insp = inspect(engine)
    found: dict[str, Any] = {
        table: {
            "pk": insp.get_pk_constraint(table)["name"],
            "fk": sorted((fk["name"], fk["referred_table"]) for fk in insp.get_foreign_keys(table)),
            "uq": sorted(uq["name"] for uq in insp.get_unique_constraints(table)),
            "ck": sorted(ck["name"] for ck in insp.get_check_constraints(table)),
            "ix": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"])) for ix in insp.get_indexes(table)),
        }
        for table in insp.get_table_names()
        if table != migrate.VERSION_TABLE
    }
    if engine.dialect.name == "postgresql":
        found["sequences"] = sorted(insp.get_sequence_names())
    return found


def test_the_migrated_schema_names_everything_as_the_models_do(fresh):
    # compare_metadata matches constraints by their columns, not their names, and sees no sequences.
    migrated, models = _names(fresh(True)), _names(fresh(False))
    assert migrated == models
    assert set(migrated) >= {OPERATIONS, ATTEMPTS}


def _every_object(engine: Engine) -> list[str]:
    """The name of every object in the database: tables, indexes, sequences, constraints, and on
    PostgreSQL the row types of tables (which an application's own type or table could collide with)."""
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":  # constraints are named in their table's CREATE statement
            rows = conn.exec_driver_sql("SELECT name, sql FROM sqlite_master").all()
            return [name for name, _ in rows] + re.findall(r"CONSTRAINT (\S+)", " ".join(sql or "" for _, sql in rows))
        schema = "(SELECT oid FROM pg_namespace WHERE nspname = current_schema())"
        return list(
            conn.exec_driver_sql(
                f"SELECT relname FROM pg_class WHERE relnamespace = {schema}"
                f" UNION ALL SELECT conname FROM pg_constraint WHERE connamespace = {schema}"
                f" UNION ALL SELECT typname FROM pg_type WHERE typnamespace = {schema}"
            ).scalars()
        )


def test_every_object_the_ledger_creates_carries_the_prefix(fresh):
    """So the ledger installs into an application's database beside any tables of its own."""
    names = _every_object(fresh(True))
    # An index's or constraint's kind comes first (the models' naming convention); SQLite names
    # the indexes of UNIQUE constraints itself; an array type is its row type's name after "_".
    carries = re.compile(rf"^((ix|uq|pk|fk|ck)_|sqlite_autoindex_|_)?{PREFIX}")
    assert len(names) > 30 and [n for n in names if not carries.match(n)] == []
