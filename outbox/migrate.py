"""Apply the ledger's alembic migrations to a database (``agent-outbox migrate``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from outbox.ledger.drivers import driver_for

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "outbox_alembic_version"


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision``; safe to run again (a no-op when up to date)."""
    _run(engine, lambda cfg: command.upgrade(cfg, revision))


def downgrade(engine: Engine, revision: str) -> None:
    """Take the schema back to ``revision`` (tests of upgrades; an operator's way back)."""
    _run(engine, lambda cfg: command.downgrade(cfg, revision))


def _run(engine: Engine, step: Callable[[Config], None]) -> None:
    cfg = _config()
    with engine.connect() as conn, driver_for(conn).migrating(conn):
        with conn.begin():
            # Two `migrate` runs at once (compose restarts, several replicas) must not race.
            driver_for(conn).lock_for_migration(conn)
            cfg.attributes["connection"] = conn
            step(cfg)


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()
