"""A throwaway PostgreSQL database for one benchmark run: created, migrated, always dropped.

The name is unique per run (``outbox_bench_<hex>``) so that two runs, or a run beside the test
suite, never share rows. It is dropped ``WITH (FORCE)`` on exit, on an exception, on Ctrl-C and on
SIGTERM, so an interrupted run leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from types import FrameType, TracebackType

import psycopg
from sqlalchemy.engine import make_url

from outbox import migrate
from outbox.ledger.db import make_engine

# Row writes per table (PostgreSQL 15 flushes a backend's counters at its exit or within a second).
TABLE_STATS = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables
WHERE n_tup_ins + n_tup_upd + n_tup_del > 0 ORDER BY relname
"""

ADMIN_URL = os.environ.get("OUTBOX_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def libpq(url: str) -> str:
    """The libpq form of a SQLAlchemy URL (for bare psycopg connections)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class ScratchDatabase:
    """``with ScratchDatabase() as db:`` gives ``db.url`` (SQLAlchemy) and ``db.name``."""

    def __init__(self, admin_url: str = ADMIN_URL) -> None:
        self.admin_url = admin_url
        self.name = f"outbox_bench_{uuid.uuid4().hex[:10]}"
        self.url = make_url(admin_url).set(database=self.name).render_as_string(hide_password=False)
        self._previous_sigterm: object = None

    def admin(self) -> psycopg.Connection:
        """An autocommit connection to the admin database: its own commits never count in ours."""
        return psycopg.connect(libpq(self.admin_url), autocommit=True, connect_timeout=5)

    def __enter__(self) -> ScratchDatabase:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        with self.admin() as admin:
            admin.execute(f'CREATE DATABASE "{self.name}"')
        try:
            engine = make_engine(self.url)
            migrate.upgrade(engine)
            engine.dispose()
        except BaseException:
            self.drop()
            raise
        return self

    def drop(self) -> None:
        self._write_table_stats()
        with self.admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def _write_table_stats(self) -> None:
        """OUTBOX_BENCH_TABLE_STATS=<file>: append this database's row writes per table (one JSON line)
        before it is dropped (bench/pg_statements.py reads them: the counters go with the database)."""
        path = os.environ.get("OUTBOX_BENCH_TABLE_STATS")
        if not path:
            return
        try:
            with psycopg.connect(libpq(self.url), autocommit=True, connect_timeout=5) as conn:
                rows = conn.execute(TABLE_STATS).fetchall()
        except psycopg.Error:
            return  # never created, or gone: nothing to count
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"database": self.name, "tables": [list(r) for r in rows]}) + "\n")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A second Ctrl-C during the drop would leave the database behind: ignore it meanwhile.
        previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.drop()
        finally:
            signal.signal(signal.SIGINT, previous_sigint)
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
