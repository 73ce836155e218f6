"""Time from the database, never from a worker's clock.

Leases, expiries and due times are computed by the database so that workers on machines with
skewed clocks agree. ``db_now(plus_s)`` compiles to ``clock_timestamp() + interval`` on PostgreSQL and
to a microsecond-formatted ``strftime`` on SQLite (stored in the same text format SQLAlchemy
uses for DateTime on SQLite, so comparisons between bound and computed values stay correct).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import DateTime, Float
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement

UTC = dt.UTC


class db_now(FunctionElement[dt.datetime]):  # noqa: N801 - reads like the SQL function it is
    """The database's current UTC time, optionally plus ``plus_s`` seconds (may be negative)."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_now"

    def __init__(self, plus_s: float = 0.0) -> None:
        super().__init__()
        # Rounded so that equal offsets share one cached statement shape.
        self.plus_s = round(float(plus_s), 6)

    def _gen_cache_key(self, anon_map: Any, bindparams: Any) -> Any:  # pragma: no cover - trivial
        return (self.__class__, self.plus_s)


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: Any, **kw: Any) -> str:
    # clock_timestamp(), not now(): now() is frozen at transaction start, and a long transaction
    # would hand out leases that are already partly spent.
    if element.plus_s:
        return f"(clock_timestamp() + make_interval(secs => {element.plus_s!r}))"
    return "clock_timestamp()"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: Any, **kw: Any) -> str:
    # '%f' gives SS.SSS; the literal '000' pads to the microsecond format SQLAlchemy writes.
    if element.plus_s:
        return f"strftime('%Y-%m-%d %H:%M:%f000', 'now', '{element.plus_s:+.6f} seconds')"
    return "strftime('%Y-%m-%d %H:%M:%f000', 'now')"


class db_scan_now(FunctionElement[dt.datetime]):  # noqa: N801 - reads like the SQL function it is
    """The database's time at the start of this statement: for "due by now" conditions that an
    index must answer (``next_attempt_at <= db_scan_now()``).

    On PostgreSQL ``statement_timestamp()``: STABLE, so the planner can use it as an index bound.
    ``clock_timestamp()`` is VOLATILE and can only filter: a claim then read the WHOLE partial
    index of due rows, dead entries included (each row leaves it on claim, and its entry stays
    until VACUUM), through a bitmap scan that never marks them dead: under a fault mix's churn a
    claim of 10 rows read hundreds of heap pages. With a bound, a plain index scan
    reads in order, stops at its LIMIT and marks the dead entries it passes, so the next scan
    skips them. The statement's start is microseconds from clock_timestamp(), and not frozen at
    the transaction's start as now() is. Not for leases handed out: those use db_now()."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_scan_now"


@compiles(db_scan_now, "postgresql")
def _pg_scan_now(element: db_scan_now, compiler: Any, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_scan_now, "sqlite")
def _sqlite_scan_now(element: db_scan_now, compiler: Any, **kw: Any) -> str:
    return "strftime('%Y-%m-%d %H:%M:%f000', 'now')"  # SQLite plans every statement afresh


@dataclass(frozen=True)
class LedgerClock:
    """The database's clock, carried into a worker process: read once (with a claim, or with the
    rows a decision is about) and then advanced by the local monotonic clock.

    Every "is it past the deadline / due / inside the window" decision a worker makes compares
    database timestamps with ``now()``, so a worker whose wall clock is minutes off decides as if
    it were right; only the monotonic clock's rate matters, over the seconds a claim lasts.
    """

    at: dt.datetime  # the database's time when read
    mono: float = field(default_factory=time.monotonic)  # this process's monotonic time then

    def now(self) -> dt.datetime:
        return self.at + dt.timedelta(seconds=time.monotonic() - self.mono)


def as_utc(value: dt.datetime | None) -> dt.datetime | None:
    """SQLite hands back naive datetimes (stored as UTC); make every datetime aware."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def to_db(value: dt.datetime) -> dt.datetime:
    """Normalise a datetime we bind as a parameter: aware UTC (SQLite drops tzinfo on write)."""
    if value.tzinfo is None:
        raise ValueError("naive datetime: pass an aware datetime (UTC)")
    return value.astimezone(UTC)


class db_age_s(FunctionElement[float]):  # noqa: N801 - reads like the SQL function it is
    """Seconds from ``expr`` (a stored timestamp) to the database's current time, as a float.

    Ages are measured on the database clock that wrote the timestamps, so a metrics exporter or
    a relay on a host with a skewed clock still reports true ages. NULL in, NULL out.
    """

    type = Float()
    inherit_cache = True
    name = "db_age_s"

    def __init__(self, expr: Any) -> None:
        super().__init__(expr)


@compiles(db_age_s, "postgresql")
def _pg_age(element: db_age_s, compiler: Any, **kw: Any) -> str:
    (expr,) = element.clauses
    return f"EXTRACT(EPOCH FROM (clock_timestamp() - {compiler.process(expr, **kw)}))::float8"


@compiles(db_age_s, "sqlite")
def _sqlite_age(element: db_age_s, compiler: Any, **kw: Any) -> str:
    (expr,) = element.clauses
    # Stored as UTC text; julianday() reads the fractional seconds (ms precision is plenty here).
    return f"((julianday('now') - julianday({compiler.process(expr, **kw)})) * 86400.0)"
