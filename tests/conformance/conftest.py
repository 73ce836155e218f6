"""The ledger driver conformance suite: one set of tests every driver passes.

Business code (submit, claims, transitions, evidence, the relay) talks to the database only
through a driver (``outbox/ledger/drivers/base.py``: the ``LedgerDriver`` protocol). These tests
call every method of that protocol through ``driver_for(...)``, on every driver, and assert its
contract, so the drivers cannot drift apart and a new driver is a checklist.

Run it: ``.venv/bin/python -m pytest tests/conformance`` (every driver; ``-k sqlite`` for one).
PostgreSQL is skipped on a laptop without it, as everywhere in the suite. Every test takes the
``case`` fixture below, parametrized over ``DRIVERS``: one driver on an emptied ledger.

The checklist, by topic (as River's riverdrivertest is organised):

- test_driver_operations.py: insert_operation, notify_due, current_row, read_due; insert_operation,
  notify_due and the producer's submit / submit_run also through each access path (below)
- test_driver_claims.py: claim, for a worker (dispatch) and for the reconciler (lookup)
- test_driver_finalize.py: finalize (each target, the "no effect" guard, stale tokens, refunds,
  batches, settlements), mark_attempt_stale
- test_driver_records.py: attempt_log, insert_evidence, insert_run
- test_driver_relay.py: mark_due, mark_rung, listener
- test_driver_engine.py: make_engine, lock_for_migration, migrating, set_statement_timeout,
  hot_path, analyze_stale
- test_driver_checklist.py: every member of the protocol is called by one of the above

Adding a driver (say, MySQL):

1. Register it in ``outbox/ledger/drivers/__init__.py`` (``_BY_BACKEND``).
2. Give ``tests/conftest.py`` a session fixture with the URL of a migrated database for the run
   (as ``pg_database_url``), and a parameter of its ``ledger`` fixture, so that the behaviour
   suite runs on the new database too.
3. Add its entry to ``DRIVERS`` below: that URL fixture, and its ``Expected`` values. Where
   drivers may legitimately differ (NOTIFY, statement timeouts, planner statistics), each driver
   states its own value and the tests assert it: a third driver's author sees each choice. List
   the ways applications reach it (their SQLAlchemy drivers, sync and async) in ``ACCESS``.
4. Run this folder until it is green. ``test_driver_checklist.py`` fails when the protocol gains a
   method no test here calls.

Access paths: an application's own transaction reaches a driver on the application's driver, not
the ledger's. The PostgreSQL driver sends its statements raw through a sync psycopg 3 connection and
through SQLAlchemy on any other (psycopg2, asyncpg, psycopg's async connection); an ``AsyncSession``
reaches either driver under ``run_sync`` (producer/aio.py). Tests that take the ``access`` fixture
(a ``Case`` whose ``within`` runs one transaction on one path of ``ACCESS``) run on every path; a
new driver lists its paths there.

Rows are set up and read through the models (``core_table(...)``) or the drivers' own methods,
never by table name. Times are read through ``as_utc`` as the callers do: SQLite hands back
naive UTC datetimes, PostgreSQL aware ones.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import pytest
from sqlalchemy import Engine, delete, exc, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.drivers import FinalizeWrite, LedgerDriver, NewOperation, driver_for
from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Attempt, Base, Operation, core_table
from outbox.ledger.states import NO_EFFECT, AttemptClass, AttemptKind, EventKind, Status, WaitingFor
from outbox.ledger.transitions import AttemptReport, report_params
from outbox.ledger.writes import waiting_on_entry

OP = core_table(Operation)
AT = core_table(Attempt)
EV = core_table(HistoryEvent)  # the whole history: events, and claims and moves recorded on attempts


@dataclass(frozen=True)
class Expected:
    """What one driver does where drivers may legitimately differ. A new driver states each."""

    name: str  # driver.name: the SQLAlchemy backend name driver_for_url maps to it
    # insert_operation / notify_due tell a listener on commit, and listener() returns one; else
    # listener() is None and the relay polls (mark_due).
    notifies: bool
    # set_statement_timeout cancels a statement that runs longer; else it is a no-op (SQLite's
    # busy timeout bounds waiting for its one write lock instead).
    statement_timeout: bool
    # analyze_stale refreshes the planner statistics of changed tables; else it returns [] (a
    # database that plans every statement afresh).
    analyzes: bool
    # mark_due leaves never-published rows due for less than fresh_grace_s to the NOTIFY path
    # (unless due before leading_since); a driver without NOTIFY has no such path: no grace.
    fresh_grace: bool
    # How a migration that leaves a row without its parent fails: the statement itself (foreign
    # keys always on), or ``migrating`` on the way out (SQLite turns them off to rebuild tables).
    dangling_row_error: type[Exception]


# Each driver: the fixture (tests/conftest.py) giving the URL of a migrated database for this run,
# and what the driver is expected to do where drivers differ.
DRIVERS: dict[str, tuple[str, Expected]] = {
    "sqlite": (
        "sqlite_database_url",
        Expected(
            name="sqlite",
            notifies=False,
            statement_timeout=False,
            analyzes=False,
            fresh_grace=False,
            dangling_row_error=RuntimeError,
        ),
    ),
    "postgres": (
        "pg_database_url",
        Expected(
            name="postgresql",
            notifies=True,
            statement_timeout=True,
            analyzes=True,
            fresh_grace=True,
            dangling_row_error=exc.IntegrityError,
        ),
    ),
}

# How an application's transaction reaches each driver: the DRIVERS entry, the SQLAlchemy driver
# of the application's URL, and whether it is an AsyncSession (run_sync) or a sync Session.
ACCESS: dict[str, tuple[str, str, bool]] = {
    "sqlite": ("sqlite", "sqlite", False),
    "sqlite-aiosqlite": ("sqlite", "sqlite+aiosqlite", True),
    "postgres-psycopg": ("postgres", "postgresql+psycopg", False),  # the raw path (the workers' too)
    "postgres-psycopg2": ("postgres", "postgresql+psycopg2", False),
    "postgres-asyncpg": ("postgres", "postgresql+asyncpg", True),
    "postgres-psycopg-async": ("postgres", "postgresql+psycopg", True),
}

ARGS = '{"amount":"10.00","order_id":"o-1"}'
T = TypeVar("T")


class Access(Protocol):
    def run(self, fn: Callable[[Session], T], *, commit: bool) -> T: ...


@dataclass(frozen=True)
class SyncAccess:
    sessions: sessionmaker[Session]

    def run(self, fn: Callable[[Session], T], *, commit: bool) -> T:
        with self.sessions() as s:
            s.begin()
            out = fn(s)
            s.commit() if commit else s.rollback()
            return out


@dataclass(frozen=True)
class AsyncAccess:
    """An AsyncSession's transaction; ``fn`` runs on its sync session (``run_sync``), as
    producer.submit_async runs submit."""

    engine: AsyncEngine
    runner: asyncio.Runner

    def run(self, fn: Callable[[Session], T], *, commit: bool) -> T:
        async def go() -> T:
            async with AsyncSession(self.engine, expire_on_commit=False) as s:
                await s.begin()
                out = await s.run_sync(fn)
                await (s.commit() if commit else s.rollback())
                return out

        return self.runner.run(go())


_keys = itertools.count()


@dataclass
class Case:
    """One driver under test on its own empty ledger, with the few steps the tests share."""

    backend: str
    url: str
    engine: Engine
    sessions: sessionmaker[Session]
    expect: Expected
    driver: LedgerDriver = field(init=False)
    access: Access = field(init=False)  # the ledger's own sessions, unless the access fixture says

    def __post_init__(self) -> None:
        self.driver = driver_for(self.engine)
        self.access = SyncAccess(self.sessions)

    def within(self, fn: Callable[[Session], T], *, commit: bool = True) -> T:
        """``fn(session)`` in one transaction of this case's access path, then commit (or roll back)."""
        return self.access.run(fn, commit=commit)

    # -- setting up -------------------------------------------------------------------------------
    def new_operation(self, **fields: Any) -> NewOperation:
        n = next(_keys)
        new = NewOperation(
            id=str(uuid.uuid4()),
            tenant="t",
            idempotency_key=f"key-{n}",
            provider_key=f"t:key-{n}",
            action="payments.refund.create",
            args=ARGS,
            args_digest="d" * 64,
            subject="agent",
            run_id=None,
            tool_call_id=None,
            status=Status.NOT_DISPATCHED,
            waiting_for=None,
            max_attempts=None,
            deadline_s=None,
            delay_s=0.0,
            reason="subject agent",
        )
        return replace(new, **fields)

    def submit(self, **fields: Any) -> str:
        """A new operation, committed; its id."""
        new = self.new_operation(**fields)
        assert self.within(lambda s: self.driver.insert_operation(s, new))
        return new.id

    def submit_many(self, n: int, *, spaced_s: float = 1.0) -> list[str]:
        """``n`` due operations, oldest first (due ``spaced_s`` apart)."""
        return [self.submit(delay_s=-(n - i) * spaced_s) for i in range(n)]

    def claim(
        self,
        kind: AttemptKind = AttemptKind.DISPATCH,
        *,
        ids: list[str] | None = None,
        limit: int = 10,
        also_due: int = 0,
        worker: str = "w1",
        lease_s: float = 30.0,
        versions: dict[str, str] | None = None,
    ) -> list[Any]:
        with self.sessions.begin() as s:
            return list(
                self.driver.claim(
                    s,
                    kind,
                    worker=worker,
                    lease_s=lease_s,
                    limit=limit,
                    operation_ids=ids,
                    also_due=also_due,
                    versions=versions,
                )
            )

    def claim_one(self, op_id: str, kind: AttemptKind = AttemptKind.DISPATCH, **kw: Any) -> Any:
        (row,) = self.claim(kind, ids=[op_id], limit=1, **kw)
        return row

    def write(
        self,
        claimed: Any,
        to: Status,
        klass: AttemptClass,
        *,
        guard: bool | None = None,
        refund: bool = False,
        token: int | None = None,
        delay_s: float = 0.0,
        result: dict[str, Any] | None = None,
        reference: str | None = None,
        reason: str = "because",
    ) -> FinalizeWrite:
        """The FinalizeWrite a worker (claimed row in dispatching) or a reconciler (claimed row in
        outcome_unknown / accepted) sends for ``claimed``'s attempt."""
        source = Status(claimed.status)
        lookup = source is not Status.DISPATCHING
        waiting = waiting_on_entry(to, WaitingFor.BACKOFF)
        report = AttemptReport(
            klass,
            status_code=200,
            request_digest="q" * 64,
            provider_request_id="req-1",
            provider_reference=reference,
            response_digest="r" * 64 if reference else None,
            retry_after_s=2.5,
            latency_s=0.125,
            error=f"{klass.value} error",
        )
        return FinalizeWrite(
            to,
            refund,
            guard if guard is not None else to in NO_EFFECT,
            {
                "reason": reason,
                "event_reason": f"attempt {claimed.number} {klass.value}: {reason}",
                "event": (EventKind.LOOKUP_RESULT if lookup else EventKind.ATTEMPT_RESULT).value,
                "actor": "w1",
                "operation_id": claimed.id,
                "token": claimed.fencing_token if token is None else token,
                "attempt_id": claimed.attempt_id,
                "waiting_for": waiting.value if waiting else None,
                "delay_s": delay_s,
                "result": result,
                **report_params(report),
            },
            source=source,
        )

    def finalize(self, *writes: FinalizeWrite) -> list[tuple[bool, bool]]:
        with self.sessions.begin() as s:
            return self.driver.finalize(s, writes)

    def set(self, op_id: str, **values: Any) -> None:
        """Put an operation row in the state a test needs (``plus_s``-style times: db_now(...))."""
        with self.sessions.begin() as s:
            s.execute(update(OP).where(OP.c.id == op_id).values(**values))

    def add_attempt(
        self, op_id: str, number: int, klass: AttemptClass, kind: AttemptKind = AttemptKind.DISPATCH, **values: Any
    ) -> int:
        """An earlier attempt on record (what claim and finalize must take into account)."""
        row = dict(
            operation_id=op_id,
            attempt_number=number,
            kind=kind.value,
            fencing_token=number,
            worker="earlier",
            started_at=db_now(-60),
            ended_at=None if klass is AttemptClass.PENDING else db_now(-59),
            attempt_class=klass.value,
            stale=False,
        )
        with self.sessions.begin() as s:
            return int(s.execute(insert(AT).values(row | values).returning(AT.c.id)).scalar_one())

    # -- reading back ------------------------------------------------------------------------------
    def op(self, op_id: str) -> Any:
        with self.sessions() as s:
            return s.execute(select(OP).where(OP.c.id == op_id)).one()

    def attempts(self, op_id: str) -> list[Any]:
        with self.sessions() as s:
            return list(s.execute(select(AT).where(AT.c.operation_id == op_id).order_by(AT.c.id)).all())

    def attempt(self, attempt_id: int) -> Any:
        with self.sessions() as s:
            return s.execute(select(AT).where(AT.c.id == attempt_id)).one()

    def events(self, op_id: str) -> list[Any]:
        with self.sessions() as s:
            return list(s.execute(select(EV).where(EV.c.operation_id == op_id).order_by(EV.c.id)).all())

    @staticmethod
    def heard(listener: Any, want: set[str], timeout_s: float = 5.0) -> list[str]:
        """What a driver's listener was told until it heard every id of ``want`` (or time ran out)."""
        got: list[str] = []
        deadline = time.monotonic() + timeout_s
        while not want <= set(got) and time.monotonic() < deadline:
            got += listener.drain()
            time.sleep(0.01)
        return got

    @staticmethod
    def seconds(a: dt.datetime | None, b: dt.datetime | None) -> float:
        """``a - b`` in seconds, on aware UTC datetimes."""
        a, b = as_utc(a), as_utc(b)
        assert a is not None and b is not None
        return (a - b).total_seconds()

    def db_time(self) -> dt.datetime:
        with self.engine.connect() as conn:
            now = as_utc(conn.execute(select(db_now())).scalar_one())
        assert now is not None
        return now


@pytest.fixture(scope="session")
def conformance_engines() -> Iterator[dict[str, Engine]]:
    """One engine per database for the whole suite: a fresh connection per test costs more than the test."""
    engines: dict[str, Engine] = {}
    yield engines
    for engine in engines.values():
        engine.dispose()


def _case(request: pytest.FixtureRequest, backend: str, engines: dict[str, Engine]) -> Case:
    url_fixture, expect = DRIVERS[backend]
    url = request.getfixturevalue(url_fixture)
    engine = engines.get(url) or engines.setdefault(url, make_engine(url))
    with engine.begin() as conn:  # DELETE, not TRUNCATE: a few rows go in milliseconds
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(delete(table))
    return Case(backend, url, engine, make_sessionmaker(engine), expect)


@pytest.fixture(params=sorted(DRIVERS))
def case(request: pytest.FixtureRequest, conformance_engines: dict[str, Engine]) -> Case:
    """One driver on an emptied ledger, with what it is expected to do."""
    return _case(request, request.param, conformance_engines)


@pytest.fixture(scope="session")
def access_engines() -> Iterator[tuple[asyncio.Runner, dict[str, Any]]]:
    """The applications' engines, one per access path, and the one event loop of the async ones."""
    engines: dict[str, Any] = {}
    with asyncio.Runner() as runner:
        yield runner, engines
        for engine in engines.values():
            if isinstance(engine, AsyncEngine):
                runner.run(engine.dispose())
            else:
                engine.dispose()


@pytest.fixture(params=sorted(ACCESS))
def access(
    request: pytest.FixtureRequest,
    conformance_engines: dict[str, Engine],
    access_engines: tuple[asyncio.Runner, dict[str, Any]],
) -> Case:
    """One driver on an emptied ledger, its ``within`` on one access path (an application's driver)."""
    backend, drivername, is_async = ACCESS[request.param]
    case = _case(request, backend, conformance_engines)
    runner, engines = access_engines
    if request.param not in engines:
        url = make_url(case.url).set(drivername=drivername).render_as_string(hide_password=False)
        make = case.driver.make_async_engine if is_async else case.driver.make_engine
        engines[request.param] = make(url)
    engine = engines[request.param]
    case.access = AsyncAccess(engine, runner) if is_async else SyncAccess(make_sessionmaker(engine))
    return case
