"""The ledger's schema is exactly what the models declare, on both backends, whichever way it was made:
a new ledger is created from the models and marked as at head (outbox/migrate.py), a ledger of an
earlier release is brought there by every migration in turn. Both are checked here against a
database made straight from the models."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

from outbox import migrate
from outbox.ledger.db import make_engine
from outbox.ledger.models import (
    ATTEMPTS,
    ATTEMPTS_FILLFACTOR,
    CLASS_VALUES,
    HISTORY,
    OPERATIONS,
    PREFIX,
    STATUS_VALUES,
    Base,
)
from outbox.ledger.states import AttemptClass, Status
from tests.conftest import scratch_pg_database

FIRST = ScriptDirectory(str(migrate.MIGRATIONS)).get_base()  # the first release's schema


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def made(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Three databases of one backend, read (never written) by the tests: ``upgraded``, brought to head
    by every migration in turn (a ledger of the first release, upgraded); ``new``, made by `migrate`
    on an empty database; ``models``, straight from the models (``create_all``)."""
    engines: dict[str, Engine] = {}
    with ExitStack() as stack:
        for how in ("upgraded", "new", "models"):
            name = f"{how}_{uuid.uuid4().hex[:8]}"
            if request.param == "sqlite":
                url = f"sqlite:///{tmp_path_factory.mktemp('schema') / name}.db"
            else:
                url = stack.enter_context(scratch_pg_database(f"outbox_test_{name}", revision="base"))
            engine = engines[how] = make_engine(url)
            stack.callback(engine.dispose)
            if how == "models":
                Base.metadata.create_all(engine)
                continue
            if how == "upgraded":
                migrate.upgrade(engine, FIRST)
            migrate.upgrade(engine)
            assert migrate.current_revision(engine) == migrate.head_revision()
        yield engines


@pytest.fixture
def upgraded(made: dict[str, Engine]) -> Engine:
    return made["upgraded"]


def test_migrated_schema_matches_the_models(upgraded):
    with upgraded.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"version_table": migrate.VERSION_TABLE, "compare_type": True, "compare_server_default": True}
        )
        diffs = compare_metadata(ctx, Base.metadata)
    # Alembic does not compare CHECK constraints at all (checked separately below) and reports
    # nothing it cannot reflect; every difference it does report is a real drift.
    assert diffs == [], "\n".join(map(repr, diffs))


def test_the_attempts_table_keeps_room_for_its_finalizes_however_the_ledger_was_made(made):
    """Storage settings are not compared by alembic: a new ledger (created from the models) and an
    upgraded one (migration 0023) must both leave a tenth of each attempts page free."""
    for how, engine in made.items():
        if engine.dialect.name != "postgresql":
            return
        with engine.connect() as conn:
            options = conn.exec_driver_sql(f"SELECT reloptions FROM pg_class WHERE relname = '{ATTEMPTS}'").scalar_one()
        assert options == [f"fillfactor={ATTEMPTS_FILLFACTOR}"], (how, options)


def test_migration_is_at_head(ledger):
    assert migrate.current_revision(ledger.engine) == migrate.head_revision()


def _checks(engine, table):
    return {c["name"]: re.sub(r"\s+", " ", c["sqltext"]) for c in inspect(engine).get_check_constraints(table)}


def test_status_check_constraint_matches_the_enum(upgraded):
    # compare_metadata ignores CHECK constraints; a status added to the enum but not migrated would
    # only fail at run time, when the first operation tries to enter it.
    sql = _checks(upgraded, OPERATIONS)[f"ck_{OPERATIONS}_status"]
    assert sorted(re.findall(r"'([a-z_]+)'", sql)) == sorted(s.value for s in Status)
    assert sorted(re.findall(r"'([a-z_]+)'", STATUS_VALUES)) == sorted(s.value for s in Status)


def test_attempt_class_check_constraints_match_the_enum(upgraded):
    expected = sorted(c.value for c in AttemptClass)
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(upgraded, ATTEMPTS)[f"ck_{ATTEMPTS}_attempt_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(upgraded, OPERATIONS)[f"ck_{OPERATIONS}_error_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", CLASS_VALUES)) == expected


def test_every_model_check_constraint_exists_in_the_database(upgraded):
    for table in Base.metadata.sorted_tables:
        declared = {c.name for c in table.constraints if c.__class__.__name__ == "CheckConstraint"}
        assert declared <= set(_checks(upgraded, table.name)), table.name


def test_partial_indexes_are_partial(upgraded):
    # The due/lease/unknown indexes stay small only if their WHERE clause survived the migration.
    indexes = {i["name"]: i for i in inspect(upgraded).get_indexes(OPERATIONS)}
    for name in (f"ix_{OPERATIONS}_due", f"ix_{OPERATIONS}_leases", f"ix_{OPERATIONS}_unknown"):
        assert name in indexes
        where = indexes[name].get("dialect_options", {}).get(f"{upgraded.dialect.name}_where")
        assert where is not None and "status" in str(where), (name, indexes[name])


def test_migrate_twice_is_a_no_op(ledger):
    before = migrate.current_revision(ledger.engine)
    migrate.upgrade(ledger.engine)
    assert migrate.current_revision(ledger.engine) == before == migrate.head_revision()


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
    # The views (outbox_history), and what each says, spaces aside: a migration that made one
    # differently from the models would show here.
    found["views"] = {v: " ".join(insp.get_view_definition(v).split()) for v in insp.get_view_names()}
    return found


def test_the_schema_names_everything_as_the_models_do(made):
    # compare_metadata matches constraints by their columns, not their names, and sees no sequences.
    models = _names(made["models"])
    assert set(models) >= {OPERATIONS, ATTEMPTS} and HISTORY in models["views"]
    assert _names(made["upgraded"]) == models
    assert _names(made["new"]) == models


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


@pytest.mark.parametrize("how", ["new", "upgraded"])
def test_every_object_the_ledger_creates_carries_the_prefix(made, how):
    """So the ledger installs into an application's database beside any tables of its own."""
    names = _every_object(made[how])
    # An index's or constraint's kind comes first (the models' naming convention); SQLite names
    # the indexes of UNIQUE constraints itself; an array type is its row type's name after "_".
    carries = re.compile(rf"^((ix|uq|pk|fk|ck)_|sqlite_autoindex_|_)?{PREFIX}")
    assert len(names) > 30 and [n for n in names if not carries.match(n)] == []
