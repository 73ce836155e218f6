"""Count commits for real: ``pg_stat_database.xact_commit`` of the bench database, read from outside.

PostgreSQL 15 keeps statistics in shared memory; a backend flushes its counters when it exits
(and at most once a second while idle). So every count is taken after all of the bench
database's client backends have gone, read from the admin database so that the reading itself
counts nowhere. Read-only transactions count too (a worker's warm-up SELECT, its last empty claim).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg

IDLE_TIMEOUT_S = 15.0  # backends exit within milliseconds of disconnect; this only catches leaks


@dataclass(frozen=True)
class Xacts:
    commits: int
    rollbacks: int

    def __sub__(self, other: Xacts) -> Xacts:
        return Xacts(self.commits - other.commits, self.rollbacks - other.rollbacks)

    def __add__(self, other: Xacts) -> Xacts:
        return Xacts(self.commits + other.commits, self.rollbacks + other.rollbacks)


def settled_xacts(admin: psycopg.Connection, dbname: str) -> Xacts:
    """The database's commit/rollback counters once no client is connected to it any more."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        (connected,) = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
            (dbname,),
        ).fetchone()  # type: ignore[misc]
        if connected == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{connected} connection(s) to {dbname} still open")
        time.sleep(0.05)
    admin.execute("SELECT pg_stat_clear_snapshot()")
    commits, rollbacks = admin.execute(
        "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()  # type: ignore[misc]
    return Xacts(int(commits), int(rollbacks))
