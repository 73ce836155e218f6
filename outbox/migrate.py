"""Apply the ledger's alembic migrations to a database (``agent-outbox migrate``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "outbox_alembic_version"


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision``; safe to run again (a no-op when up to date)."""
    cfg = _config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Two `migrate` runs at once (compose restarts, several replicas) must not race.
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7243011)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()
