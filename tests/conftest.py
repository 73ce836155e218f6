"""Shared fixtures: real PostgreSQL (a fresh database per test run), real Redis, real SQLite files.

Services:
- PostgreSQL: ``OUTBOX_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``) is
  the admin connection; every run creates its own database ``outbox_test_<unique>`` and drops it at
  the end, so runs never share state.
- Redis: ``OUTBOX_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); tests use unique key
  prefixes and never flush.
On a laptop without them, the tests that need them are skipped and the summary says how to start
them (``docker compose up -d postgres redis``). In CI (``CI`` set) a missing service is a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from outbox import migrate
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.key_uses import KEY_USES
from outbox.ledger.models import (
    API_KEYS,
    APPROVALS,
    ATTEMPTS,
    EVIDENCE,
    HANDOFFS,
    OPERATION_EVENTS,
    OPERATIONS,
    REPORT_RUNS,
    RUNS,
)
from outbox.ledger.scope_models import BUDGET_CHARGES, BUDGET_SCOPES, OBJECT_HOLDS
from outbox.ledger.stop_models import SUBJECT_STOPS
from outbox.ledger.webhook_models import WEBHOOK_EVENTS
from tests.harness import MOVES_TAKEN, record_moves

# docker-compose.yml's postgres, as published on 127.0.0.1 (its redis is the default below).
COMPOSE_PG_URL = "postgresql+psycopg://outbox:outbox@127.0.0.1:5432/outbox"
PG_ADMIN_URL = os.environ.get("OUTBOX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
IN_CI = bool(os.environ.get("CI"))
RUN_ID = uuid.uuid4().hex[:10]
TABLES = (HANDOFFS, APPROVALS, EVIDENCE, OPERATION_EVENTS, ATTEMPTS, OPERATIONS, API_KEYS, RUNS, REPORT_RUNS)
TABLES += (OBJECT_HOLDS, BUDGET_SCOPES, WEBHOOK_EVENTS)
TABLES += (SUBJECT_STOPS, BUDGET_CHARGES, KEY_USES)

# Tests that took 12 s or more in a parallel run (`make test` prints the 30 slowest): marked slow and
# handed out first, so that the run does not end with one process working through a long test while
# the others idle. A scheduling hint only: a test missing here still runs, a little later.
SLOW = (
    "tests/conformance/test_driver_authority.py::test_a_stop_of_thousands_of_queued_rows_holds_each_and_records_each_in_the_history",
    "tests/faults/test_accepted.py::test_accepted_waits_for_the_provider_and_ends_as_the_provider_says",
    "tests/faults/test_broker_outage.py::test_redis_killed_under_load_loses_nothing_and_logs_no_error",
    "tests/faults/test_ledger_restart.py::test_one_ledger_restarted_the_other_keeps_flowing_nothing_lost_or_doubled",
    "tests/faults/test_liveness.py::test_five_thousand_intents_settle_under_faults",
    "tests/faults/test_pacing_faults.py::test_redis_restarted_mid_run_each_process_keeps_to_its_share",
    "tests/faults/test_poison_intent.py::test_poison_intent_parks_at_the_attempt_cap_while_others_flow",
    "tests/faults/test_postgres_restart.py::test_postgres_restart_under_load_loses_nothing_and_logs_no_error",
    "tests/faults/test_reconcile_soak.py::test_a_steady_load_keeps_the_reconcilers_backlog_bounded",
    "tests/faults/test_run_parent_killed.py::test_a_run_killed_by_sigkill_takes_its_worker_and_the_pool_with_it",
    "tests/faults/test_scale_proof.py::test_scale_proof_holds_every_invariant",
    "tests/integration/agents/test_agent_examples.py::test_the_example_runs_offline_and_makes_one_refund",
    "tests/integration/surfaces/test_api.py::test_a_full_backlog_answers_new_intents_429_and_still_answers_replays",
    "tests/integration/surfaces/test_api.py::test_several_server_processes_share_the_ledger_and_answer_keep_alive_requests_at_once",
    "tests/integration/surfaces/test_api.py::test_wait_returns_each_outcome",
    "tests/integration/surfaces/test_api_fuzz.py::test_schemathesis_finds_nothing_with_every_check_in_every_phase",
    "tests/integration/approvals/test_approvals.py::test_approve_then_dispatch_makes_one_effect_and_says_who",
    "tests/integration/dispatch/test_authority.py::test_a_stopped_subject_stays_unsent_while_another_flows_and_resume_sends_each_once",
    "tests/integration/dispatch/test_breaker_dispatch.py::test_breaker_storage_stopped_degrades_to_local_breakers_and_loses_nothing",
    "tests/integration/dispatch/test_breaker_dispatch.py::test_open_breaker_is_shared_parks_without_spending_attempts_and_recovers",
    "tests/integration/surfaces/test_cli.py::test_demo_runs_on_the_embedded_default_in_an_empty_folder",
    "tests/integration/packaging/test_core_install.py::test_a_sqlite_ledger_runs_the_pipeline_on_the_core_install",
    "tests/integration/packaging/test_core_install.py::test_the_sandbox_and_the_demo_name_the_extra_they_need",
    "tests/integration/reconcile/test_handoff_cases.py::test_a_handoff_made_in_an_outage_resolves_itself_when_the_provider_answers_again",
    "tests/integration/reconcile/test_handoff_cases.py::test_an_abandoned_case_is_retried_as_a_new_intent_only_by_a_person",
    "tests/integration/surfaces/test_handoffs_cli.py::test_resolutions_are_written_back_and_acted_on",
    "tests/integration/observability/test_health.py::test_a_frozen_worker_or_relay_fails_its_probe_and_passes_again_when_thawed",
    "tests/integration/surfaces/test_http_client.py::test_submit_wait_and_replay_make_one_effect",
    "tests/integration/agents/test_langgraph.py::test_interrupted_for_approval_resumed_in_a_new_process_one_effect",
    "tests/integration/surfaces/test_mcp_tasks.py::test_tasks_over_stdio",
    "tests/integration/surfaces/test_mcp_tasks.py::test_tasks_over_streamable_http",
    "tests/integration/dispatch/test_one_request_per_key.py::test_a_purged_request_is_not_rebuilt_under_another_definition",
    "tests/integration/dispatch/test_one_request_per_key.py::test_a_retry_after_a_deploy_sends_the_first_request_again",
    "tests/integration/dispatch/test_pacing_dispatch.py::test_another_tenant_is_not_put_behind_one_tenants_backlog_at_a_limited_target",
    "tests/integration/reconcile/test_reconcile.py::test_worker_killed_after_the_provider_committed",
    "tests/integration/reconcile/test_report.py::test_report_finds_planted_duplicate_and_orphan",
    "tests/integration/runs/test_runs.py::test_runs_submit_from_a_file_names_bad_fields_and_resubmits_the_same_run",
    "tests/integration/ledger/test_state_machine_property.py::test_random_event_sequences_keep_the_ledger_invariants_on_sqlite",
    "tests/integration/surfaces/test_tenants.py::test_a_canary_secret_reaches_no_output",
    "tests/integration/surfaces/test_tenants.py::test_purge_removes_payload_of_old_terminal_operations_and_keeps_their_story",
    "tests/integration/packaging/test_testkit.py::test_the_example_runs_against_a_provider_of_ones_own_by_url",
    "tests/integration/packaging/test_testkit.py::test_the_example_tests_pass_from_a_fresh_copy",
    "tests/integration/packaging/test_testkit.py::test_the_plain_script_submits_and_waits_for_the_outcome",
    "tests/integration/ledger/test_upgrade.py::test_a_ledger_of_4cd0727_with_work_in_flight_upgrades_and_real_workers_settle_it",
    "tests/unit/test_types.py::test_our_packages_type_check_strictly",
)


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle: random order within each group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_skipped_services: dict[str, str] = {}


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def service_missing(name: str, why: str, *, get_it: str | None = None) -> None:
    """Skip on a laptop, fail in CI: a missing service must never turn into a green CI run.
    ``get_it``: how to get it (default: its docker compose service)."""
    if IN_CI:
        pytest.fail(f"{name} is required in CI but unavailable: {why}", pytrace=False)
    _skipped_services[name] = why
    default = f"docker compose up -d {name}" + (
        f" and OUTBOX_TEST_PG_URL={COMPOSE_PG_URL}" if name == "postgres" else ""
    )
    pytest.skip(f"{name} unavailable ({why}); get it with `{get_it or default}`")


# One migrated template per run, shared by the run's processes: each process's database and each
# test's scratch database at the head revision is a copy of it (CREATE DATABASE ... TEMPLATE) instead
# of a migration of its own. Made by whichever process asks first (an advisory lock orders them),
# dropped by the process that ends the run. Its name travels in the environment: xdist's processes
# inherit it from the controller, and a second import of this module (as tests.conftest) keeps it.
TEMPLATE = os.environ.setdefault("OUTBOX_TEST_TEMPLATE_DB", f"outbox_template_{uuid.uuid4().hex[:10]}")
_TEMPLATE_LOCK = 0x6F7574626F78  # pg_advisory_lock key: "outbox" in ASCII


def _admin() -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(_libpq(PG_ADMIN_URL), autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        service_missing("postgres", str(exc).strip().splitlines()[0])
        raise  # not reached: service_missing skips or fails


def _url_of(name: str) -> str:
    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)


def _ensure_template(admin: psycopg.Connection[Any]) -> None:
    admin.execute("SELECT pg_advisory_lock(%s)", (_TEMPLATE_LOCK,))
    try:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (TEMPLATE,)).fetchone() is None:
            # Built under another name and renamed once migrated: a process that dies mid-migration
            # (its lock goes with its connection) leaves no half-built template for the others to copy.
            building = f"{TEMPLATE}_building"
            admin.execute(f'DROP DATABASE IF EXISTS "{building}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{building}"')
            engine = make_engine(_url_of(building))
            try:
                migrate.upgrade(engine, "head")
            finally:
                engine.dispose()  # a template takes no copies while anyone is connected to it
            admin.execute(f'ALTER DATABASE "{building}" RENAME TO "{TEMPLATE}"')
    finally:
        admin.execute("SELECT pg_advisory_unlock(%s)", (_TEMPLATE_LOCK,))


def drop_template() -> None:
    try:
        with psycopg.connect(_libpq(PG_ADMIN_URL), autocommit=True, connect_timeout=3) as admin:
            for name in (TEMPLATE, f"{TEMPLATE}_building"):
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except psycopg.OperationalError:
        pass  # no PostgreSQL: no template was made


@contextmanager
def scratch_pg_database(name: str, *, revision: str = "head") -> Iterator[str]:
    """A new PostgreSQL database ``name`` migrated to ``revision`` (at the head: a copy of the run's
    migrated template); its URL; dropped afterwards."""
    with _admin() as admin:
        if revision == "head":
            _ensure_template(admin)
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
        else:
            admin.execute(f'CREATE DATABASE "{name}"')
    url = _url_of(name)
    try:
        if revision != "head":
            engine = make_engine(url)
            migrate.upgrade(engine, revision)
            engine.dispose()
        yield url
    finally:
        with psycopg.connect(_libpq(PG_ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_database_url() -> Iterator[str]:
    """URL of a fresh, migrated PostgreSQL database for this test run (dropped afterwards)."""
    with scratch_pg_database(f"outbox_test_{RUN_ID}") as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("ledger") / "outbox.ledger.db"
    url = f"sqlite:///{path}"
    engine = make_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    return url


@dataclass
class Ledger:
    """A migrated, empty ledger on one backend."""

    backend: str
    url: str
    engine: Engine
    sessions: sessionmaker[Session]

    def new_engine(self) -> Engine:
        """A second engine (its own connections), e.g. for race tests."""
        return make_engine(self.url)


# Every (from, to) status pair the suite's operations moved through is in tests/harness.py MOVES_TAKEN
# (filled by record_moves before each ledger is emptied); at the end of the run each must be a move of
# states.ALLOWED.
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from outbox.ledger.states import ALLOWED

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist process: the controller checks what every process saw
        workeroutput["moves_taken"] = sorted(list(move) for move in MOVES_TAKEN)
        workeroutput["skipped_services"] = dict(_skipped_services)
        return
    drop_template()  # the controller, or the one process of a serial run: the run is over

    allowed = {(a.value, b.value) for a, b in ALLOWED}
    unlisted = sorted(MOVES_TAKEN - allowed)
    if unlisted:
        session.config.get_terminal_writer().line(
            f"moves taken in this run that outbox/ledger/states.py ALLOWED does not list: {unlisted}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: gather each process's moves and skipped services (its sessionfinish and
    terminal summary would be seen and counted by nobody)."""
    output = getattr(node, "workeroutput", {})
    MOVES_TAKEN.update((a, b) for a, b in output.get("moves_taken", []))
    _skipped_services.update(output.get("skipped_services", {}))


def _truncate(engine: Engine) -> None:
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # A test that leaked an open transaction must fail fast here, not hang the run.
            conn.execute(text("SET LOCAL lock_timeout = '10s'"))
            conn.execute(text("TRUNCATE " + ", ".join(TABLES) + " RESTART IDENTITY CASCADE"))
        else:
            for table in TABLES:
                conn.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request: pytest.FixtureRequest) -> Iterator[Ledger]:
    """The same behaviour suite runs on the embedded default and on PostgreSQL."""
    if request.param == "postgres":
        url = request.getfixturevalue("pg_database_url")
    else:
        url = request.getfixturevalue("sqlite_database_url")
    engine = make_engine(url)
    _truncate(engine)
    yield Ledger(request.param, url, engine, make_sessionmaker(engine))
    record_moves(engine)
    engine.dispose()


@pytest.fixture
def pg_ledger(pg_database_url: str) -> Iterator[Ledger]:
    engine = make_engine(pg_database_url)
    _truncate(engine)
    yield Ledger("postgres", pg_database_url, engine, make_sessionmaker(engine))
    record_moves(engine)
    engine.dispose()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of the test's own (tests/harness.py PrivateRedis), safe to SIGKILL and restart.
    Request it before ``pipe``: it is then torn down after the workers and the relay."""
    from tests.harness import PrivateRedis

    server = PrivateRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_url() -> str:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        service_missing("redis", str(exc))
    return REDIS_URL


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skipped_services:
        terminalreporter.section("services not available: tests skipped")
        for name, why in _skipped_services.items():
            terminalreporter.write_line(f"{name}: {why}")
        terminalreporter.write_line(
            "The embedded (SQLite) suite ran. To run everything: `docker compose up -d postgres redis` and "
            "`apt-get install chromium faketime`, then "
            f"`OUTBOX_TEST_PG_URL={COMPOSE_PG_URL} make test` (or point OUTBOX_TEST_PG_URL / OUTBOX_TEST_REDIS_URL "
            "at servers of your own)."
        )


@pytest.fixture(scope="session")
def sandbox_server() -> Iterator[Any]:
    from workers.sandbox.testing import SandboxServer

    with SandboxServer(seed=1) as server:
        yield server


@pytest.fixture
def sandbox(sandbox_server: Any) -> Any:
    """The sandbox provider over real HTTP, reset (objects, keys, faults, request log) per test."""
    sandbox_server.reset()
    return sandbox_server


@pytest.fixture
def pipe(pg_ledger: Ledger, redis_url: str, sandbox: Any, tmp_path: Path) -> Iterator[Any]:
    """PostgreSQL ledger + Redis broker + sandbox; start workers/relay with pipe.start_worker()/start_relay()."""
    from tests.harness import pipeline

    with pipeline(
        db_url=pg_ledger.url, sessions=pg_ledger.sessions, redis_url=redis_url, tmp=tmp_path, sandbox_url=sandbox.url
    ) as p:
        yield p
