"""The alembic-migrated schema is exactly what the models declare, on both backends."""

from __future__ import annotations

import re

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from outbox import migrate
from outbox.ledger.models import CLASS_VALUES, STATUS_VALUES, Base
from outbox.ledger.states import AttemptClass, Status


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
    sql = _checks(ledger, "operations")["ck_operations_status"]
    assert sorted(re.findall(r"'([a-z_]+)'", sql)) == sorted(s.value for s in Status)
    assert sorted(re.findall(r"'([a-z_]+)'", STATUS_VALUES)) == sorted(s.value for s in Status)


def test_attempt_class_check_constraints_match_the_enum(ledger):
    expected = sorted(c.value for c in AttemptClass)
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(ledger, "attempts")["ck_attempts_attempt_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", _checks(ledger, "operations")["ck_operations_error_class"])) == expected
    assert sorted(re.findall(r"'([a-z_]+)'", CLASS_VALUES)) == expected


def test_every_model_check_constraint_exists_in_the_database(ledger):
    for table in Base.metadata.sorted_tables:
        declared = {c.name for c in table.constraints if c.__class__.__name__ == "CheckConstraint"}
        assert declared <= set(_checks(ledger, table.name)), table.name


def test_partial_indexes_are_partial(ledger):
    # The due/lease/unknown indexes stay small only if their WHERE clause survived the migration.
    indexes = {i["name"]: i for i in inspect(ledger.engine).get_indexes("operations")}
    for name in ("ix_operations_due", "ix_operations_leases", "ix_operations_unknown"):
        assert name in indexes
        where = indexes[name].get("dialect_options", {}).get(f"{ledger.engine.dialect.name}_where")
        assert where is not None and "status" in str(where), (name, indexes[name])


def test_migrate_twice_is_a_no_op(ledger):
    before = migrate.current_revision(ledger.engine)
    migrate.upgrade(ledger.engine)
    assert migrate.current_revision(ledger.engine) == before == migrate.head_revision()
