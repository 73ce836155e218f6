"""Fresh planner statistics for the queue tables, on PostgreSQL.

The ledger's hot statements are prepared once per connection and run on generic plans
(drivers/postgres.py; the statements: drivers/sql/). PostgreSQL plans them from the statistics of the moment, and its
autovacuum refreshes those only after 10% of a table has changed, checking once a minute. A queue
table outruns that: planned while ``outbox_operations`` was empty (a new deployment) or while the due
set was tiny (a steady state), a doorbell's claim of ten ids scanned the whole partial index of
due rows, and the evidence query scanned all of ``attempts``: per doorbell, work proportional
to the backlog, just when a backlog builds. ``refresh_if_stale``
runs ANALYZE on a queue table
once enough of it changed since its last analysis; ANALYZE invalidates the cached plans, so every
connection re-plans its next execution.

Called by the relay's sweep (workers/relay/loop.py), at most every ``MIN_INTERVAL_S``. ANALYZE reads a
sample (30,000 rows by default) and takes no lock that blocks reads or writes. Without the right
to ANALYZE (not the tables' owner) it says so once and leaves the statistics to autovacuum.

What it costs: a young ledger's tables change by a fifth every few seconds, so the relay analyzes
them every ``MIN_INTERVAL_S`` while they grow, and a whole-table ANALYZE was 13% of the database's
CPU in ``bench.pg_statements`` (its statistics for the wide text columns -- arguments,
results, errors -- cost most and no plan reads them). So a table's first analysis by this relay,
and one every ``ALL_COLUMNS_EVERY_S``, covers every column; the others only the columns its
indexes key or filter on (id, key, status, due time, ...), which is what the plans are chosen on:
~80 instead of ~220 ms for 40,000 operations, ~35 instead of ~110 for their attempts. Such an
ANALYZE leaves PostgreSQL's own count of changes since the last analysis as it was, so autovacuum
still analyzes every column on its own schedule, and this relay counts its changes from its own
mark (the driver's ``seen``).

A young table (fewer than ``YOUNG_ROWS`` rows when last analyzed, or never) is analyzed also each
time it has doubled since, from ``YOUNG_FIRST_ROWS`` rows, and that rule alone is looked at every
sweep while a table is young (the others every ``MIN_INTERVAL_S``): a new ledger's first claims are
planned on tables of a few rows, and keep that plan while the tables grow until an ANALYZE makes
them re-plan (a claim's update read every operation row, a finalize every attempt row, for the
first ~1,500 operations of a benchmark, the first ANALYZE coming ~4 s in). The driver prices the hot
path's page reads so that plans made at ~100 rows already use the keys (drivers/sql/housekeeping.sql,
generic_plans); the doubling re-plans what was made before that. Its analyses are a dozen by 10,000
rows, most of the searched columns, once per ledger (``bench.pg_statements --ops 3000``: 7-12
ANALYZE statements, 83-145 ms in all, against 4 and 44-84 ms before); a ledger that stays small is
looked at every sweep (~0.5 ms), analyzed only by the rules.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from outbox.ledger.drivers import driver_for
from outbox.ledger.drivers.base import StaleRules
from outbox.ledger.models import ATTEMPTS, OPERATIONS

log = logging.getLogger(__name__)

TABLES = (OPERATIONS, ATTEMPTS)
# Analyze a table when at least this many of its rows changed since its last analysis, and at
# least this share of its live rows (a large steady ledger is not re-analyzed for every burst).
MIN_CHANGED_ROWS = 1000
MIN_CHANGED_SHARE = 0.2
MIN_INTERVAL_S = 5.0
# Young tables: analyzed when doubled since their last analysis (from YOUNG_FIRST_ROWS rows), and
# looked at every sweep while any queue table is young.
YOUNG_ROWS = 10_000
YOUNG_FIRST_ROWS = 250
NEVER = 2**62  # MIN_CHANGED_ROWS between the MIN_INTERVAL_S looks: only the young tables' rule
ALL_COLUMNS_EVERY_S = 600.0
INSUFFICIENT_PRIVILEGE = "42501"  # SQLSTATE (psycopg.errors.InsufficientPrivilege)


class PlannerStats:
    """One relay's keeper of the queue tables' statistics (the driver's analyze_stale: PostgreSQL
    analyzes, SQLite has nothing to do)."""

    def __init__(self, engine: Engine, *, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.engine = engine
        self.enabled = True
        self.min_interval_s = min_interval_s
        self._last = float("-inf")  # the last look by every rule
        self._all_columns_at = float("-inf")
        self._seen: dict[str, int] = {}  # each table's count of changes when analyzed here last
        self._young: set[str] = set(TABLES)  # the tables young at the last look (all, before the first)
        self.analyzed: list[str] = []  # every table analyzed here, in order (for tests and logs)

    def refresh_if_stale(self) -> list[str]:
        """ANALYZE the queue tables that changed enough; returns the tables analyzed."""
        now = time.monotonic()
        every_rule = now - self._last >= self.min_interval_s  # else the young tables' rule alone
        if not self.enabled or not (every_rule or self._young):
            return []
        if every_rule:
            self._last = now
        if now - self._all_columns_at >= ALL_COLUMNS_EVERY_S:  # forget the marks: every column again
            self._all_columns_at = now
            self._seen.clear()
        # The driver's own errors (PEP 249's Error: psycopg.Error on PostgreSQL) reach us unwrapped:
        # it sends its statements through the driver connection. Asked of the engine, not imported:
        # a SQLite ledger runs without psycopg.
        dbapi_error: type[Exception] = self.engine.dialect.loaded_dbapi.Error
        try:
            with self.engine.connect() as conn:
                min_rows = MIN_CHANGED_ROWS if every_rule else NEVER
                rules = StaleRules(min_rows, MIN_CHANGED_SHARE, YOUNG_ROWS, YOUNG_FIRST_ROWS)
                stale = driver_for(self.engine).analyze_stale(conn, TABLES, rules, seen=self._seen)
                conn.commit()
                self._young = rules.young
        except (DBAPIError, dbapi_error) as exc:
            cause = exc.orig if isinstance(exc, DBAPIError) else exc
            self._seen.clear()  # marks of analyses rolled back with it: every column next time
            self._young = set(TABLES)  # and the young tables' counts with them: look again next sweep
            if getattr(cause, "sqlstate", None) == INSUFFICIENT_PRIVILEGE:
                log.warning("planner statistics left to autovacuum: %s", str(cause).strip())
                self.enabled = False
            else:  # the ledger is away (the relay's tick says so): try again next time
                log.debug("planner statistics not refreshed: %s", exc)
            return []
        if stale:
            log.info("planner statistics refreshed: %s", ", ".join(stale))
            self.analyzed.extend(stale)
        return stale
