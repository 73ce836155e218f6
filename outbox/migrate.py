"""Apply the ledger's alembic migrations to a database (``agent-outbox migrate``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Base

MIGRATIONS = Path(__file__).with_name("migrations")
VERSION_TABLE = "outbox_alembic_version"


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to ``revision``; safe to run again (a no-op when up to date).

    A database without a ledger gets the head schema at once, created from the models and marked
    as at head (alembic's way to build an up-to-date database): the older revisions name the tables
    as earlier releases did (``runs``, ``approvals``), which the application's own tables may hold.
    A ledger made by an earlier release is brought to head by the migrations; a test checks that
    both ways give the same schema.
    """

    def step(cfg: Config) -> None:
        if revision == "head" and _revision(cfg.attributes["connection"]) is None:
            # checkfirst=False: a ledger table without a version table is an error to see, not to skip.
            Base.metadata.create_all(cfg.attributes["connection"], checkfirst=False)
            command.stamp(cfg, "head")
        else:
            command.upgrade(cfg, revision)

    _run(engine, step)


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
        return _revision(conn)


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def head_revision() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()
