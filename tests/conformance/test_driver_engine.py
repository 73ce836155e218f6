"""Conformance: the engine and its connections (make_engine, lock_for_migration, migrating,
set_statement_timeout, hot_path, analyze_stale). See conftest.py for how to run this against a
new driver."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import exc, select, text
from sqlalchemy.engine import make_url

from outbox.ledger.drivers import driver_for
from outbox.ledger.drivers.base import StaleRules
from outbox.ledger.models import Attempt, Operation, core_table
from outbox.ledger.states import AttemptClass, AttemptKind

OP, AT = core_table(Operation), core_table(Attempt)
# Long enough that a 1 ms statement timeout cancels it; short enough to run in full (~0.1 s).
SLOW = text("WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 200000) SELECT count(*) FROM c")


def orphan_attempt(conn: Any) -> None:
    conn.execute(
        AT.insert().values(
            operation_id="no-such-operation",
            attempt_number=1,
            kind="dispatch",
            fencing_token=1,
            worker="w",
            started_at=text("CURRENT_TIMESTAMP"),
            attempt_class="pending",
            stale=False,
        )
    )


# -- make_engine ----------------------------------------------------------------------------------
def test_make_engine_opens_the_url_with_the_callers_engine_options(case):
    engine = case.driver.make_engine(case.url, pool_pre_ping=True, pool_size=2)
    try:
        assert engine.url == make_url(case.url) and driver_for(engine) is case.driver
        assert engine.pool._pre_ping and engine.pool.size() == 2  # type: ignore[attr-defined]
        with engine.connect() as conn:
            assert conn.execute(select(OP.c.id)).all() == []
    finally:
        engine.dispose()


def test_make_async_engine_opens_the_same_database_through_an_async_driver(case):
    """A URL of a sync-only driver (the ledger's own settings) opens the database through an async one."""
    import asyncio

    from sqlalchemy.ext.asyncio import AsyncSession

    op_id = case.submit()
    engine = case.driver.make_async_engine(case.url)

    async def read() -> list[Any]:
        try:
            async with AsyncSession(engine) as s:
                return list((await s.execute(select(OP.c.id))).scalars())
        finally:
            await engine.dispose()

    assert engine.dialect.is_async and driver_for(engine.sync_engine) is case.driver
    assert make_url(str(engine.url)).database == make_url(case.url).database
    assert asyncio.run(read()) == [op_id]


def test_make_engine_enforces_foreign_keys(case):
    with pytest.raises(exc.IntegrityError):
        case.add_attempt("no-such-operation", 1, AttemptClass.PENDING)


def test_make_engine_lets_two_transactions_that_read_then_write_both_commit(case):
    """Each reads, then writes: neither fails for a lock (the second waits, or does not need to)."""
    started, errors = threading.Event(), []

    def read_then_write(first: bool) -> None:
        try:
            if not first:
                started.wait(5)
            with case.sessions.begin() as s:
                s.execute(select(OP.c.id)).all()
                if first:
                    started.set()
                    time.sleep(0.2)  # the other transaction starts meanwhile
                case.driver.insert_operation(s, case.new_operation())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read_then_write, args=(first,)) for first in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert errors == []
    with case.sessions() as s:
        assert len(s.execute(select(OP.c.id)).all()) == 2


# -- migrations -------------------------------------------------------------------------------------
def test_lock_for_migration_holds_a_second_migrator_off_until_the_first_commits(case):
    released: list[float] = []
    taken: list[float] = []
    holding = threading.Event()

    def second() -> None:
        holding.wait(5)
        with case.engine.connect() as conn, conn.begin():
            case.driver.lock_for_migration(conn)
            taken.append(time.monotonic())

    other = threading.Thread(target=second)
    other.start()
    with case.engine.connect() as conn:
        with conn.begin():
            case.driver.lock_for_migration(conn)
            holding.set()
            time.sleep(0.3)
            released.append(time.monotonic())
    other.join(15)
    assert taken and taken[0] >= released[0]


def test_migrating_leaves_the_connection_enforcing_foreign_keys(case):
    with case.engine.connect() as conn:
        with case.driver.migrating(conn):
            with conn.begin():
                case.driver.lock_for_migration(conn)
                conn.execute(select(OP.c.id)).all()
        with pytest.raises(exc.IntegrityError), conn.begin():
            orphan_attempt(conn)


def test_migrating_refuses_a_migration_that_leaves_a_row_without_its_parent(case):
    """Where it is refused differs: PostgreSQL's foreign keys refuse the statement; SQLite's are off
    while a migration rebuilds tables, so ``migrating`` checks them on the way out."""
    try:
        with pytest.raises(case.expect.dangling_row_error):
            with case.engine.connect() as conn, case.driver.migrating(conn):
                with conn.begin():
                    orphan_attempt(conn)
    finally:  # a later migration of this database must not find it
        with case.engine.begin() as conn:
            conn.execute(AT.delete().where(AT.c.operation_id == "no-such-operation"))


# -- statement timeout -----------------------------------------------------------------------------
def test_set_statement_timeout_bounds_the_statements_of_that_transaction_only(case):
    if case.expect.statement_timeout:
        with pytest.raises(exc.OperationalError), case.sessions.begin() as s:
            case.driver.set_statement_timeout(s, 1)
            s.execute(SLOW)
    else:
        with case.sessions.begin() as s:
            case.driver.set_statement_timeout(s, 1)  # accepted: nothing bounds a statement here
            assert s.execute(SLOW).scalar_one() == 200000
    with case.sessions.begin() as s:
        assert s.execute(SLOW).scalar_one() == 200000, "the next transaction has no timeout"


# -- hot path ---------------------------------------------------------------------------------------
def test_hot_path_one_statement_gives_a_handle_the_driver_methods_accept_and_commits_the_statement(case):
    op_id = case.submit()
    path = case.driver.hot_path(case.engine, case.sessions)
    try:
        with path.one_statement() as handle:
            assert driver_for(handle) is case.driver
            (row,) = case.driver.claim(
                handle, AttemptKind.DISPATCH, worker="w", lease_s=30, limit=1, operation_ids=[op_id], also_due=0
            )
        assert case.op(op_id).fencing_token == row.fencing_token == 1
    finally:
        path.close()


def test_hot_path_transaction_commits_its_statements_together_or_none_of_them(case):
    path = case.driver.hot_path(case.engine, case.sessions)
    kept, lost = [case.new_operation() for _ in range(2)], [case.new_operation() for _ in range(2)]
    try:
        with pytest.raises(RuntimeError), path.transaction() as handle:
            for new in lost:
                case.driver.insert_operation(handle, new)
            raise RuntimeError("the doorbell failed half way")
        with path.transaction() as handle:
            for new in kept:
                case.driver.insert_operation(handle, new)
    finally:
        path.close()
    with case.sessions() as s:
        found = {r.id for r in s.execute(select(OP.c.id)).all()}
    assert found == {new.id for new in kept}


def test_hot_path_after_close_connects_again_on_next_use(case):
    op_id = case.submit()
    path = case.driver.hot_path(case.engine, case.sessions)
    with path.one_statement() as handle:
        assert case.driver.current_row(handle, op_id).status == "not_dispatched"
    path.close()
    path.close()  # closing twice is harmless
    with path.one_statement() as handle:
        assert case.driver.current_row(handle, op_id).status == "not_dispatched"
    path.close()


# -- planner statistics ---------------------------------------------------------------------------------
def test_analyze_stale_refreshes_changed_tables_where_the_database_keeps_statistics(case):
    tables = (OP.name, AT.name)
    for _ in range(3):
        case.submit()

    def analyze(**kw: Any) -> list[str]:
        given = kw.pop("tables", tables)
        with case.engine.connect() as conn:
            done = case.driver.analyze_stale(conn, given, StaleRules(**({"min_rows": 1, "share": 0.0} | kw)))
            conn.commit()
        return done

    assert analyze(min_rows=10**9) == [], "not changed enough"
    assert analyze(tables=()) == []
    if not case.expect.analyzes:
        assert analyze() == []
        return
    deadline = time.monotonic() + 10  # the activity counters arrive within about a second
    done: list[str] = []
    while OP.name not in done and time.monotonic() < deadline:
        case.submit()  # a change each time: an autovacuum's ANALYZE meanwhile cannot leave it unchanged
        done = analyze()
        time.sleep(0.1)
    assert OP.name in done and set(done) <= set(tables)

    # Unchanged since, it is left alone. A backend reports its changes to the statistics up to a second
    # after its commit, and up to a minute later when the shared statistics are contended (PostgreSQL's
    # PGSTAT_MAX_INTERVAL; seen on a loaded machine): wait until the table's counts of changes stand
    # still for two seconds, analyze what arrived, and then the next analysis must find nothing. A
    # driver that analyzed whatever it was given fails here whatever the timing.
    def changes() -> int:
        with case.engine.connect() as conn:  # one transaction per read: the statistics are cached within one
            return conn.execute(
                text("SELECT n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables WHERE relname = :t"),
                {"t": OP.name},
            ).scalar_one()

    deadline, last, still_since = time.monotonic() + 65, changes(), time.monotonic()
    while time.monotonic() - still_since < 2 and time.monotonic() < deadline:
        time.sleep(0.25)
        if (now := changes()) != last:
            last, still_since = now, time.monotonic()
    with case.engine.connect() as conn:
        writers = conn.execute(
            text(
                "SELECT application_name, state, left(query, 120) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ).all()
    assert time.monotonic() - still_since >= 2, f"the table kept changing for a minute; connected: {writers}"
    analyze()
    assert OP.name not in analyze(), f"analyzed: unchanged since (connected: {writers})"
