"""``agent-outbox metrics`` as a subprocess: the ledger's figures, breaker state, the last report,
and counters summed over prefork-like processes (prometheus_client multiprocess mode)."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from breaker import BreakerConfig, BreakerRegistry
from outbox.evidence.handoffs import open_handoff
from outbox.ledger.clock import db_now
from outbox.ledger.models import Handoff, Operation
from outbox.reads.report_summary import record_report
from producer import submit
from tests import spawn
from tests.harness import REFUND_ARGS, actions_doc, wait_for

ROOT = Path(__file__).resolve().parents[3]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@contextmanager
def exporter(env: dict[str, str]) -> Iterator[str]:
    port = _free_port()
    # Only what the test passes decides whether the exporter reads a multiprocess directory.
    base = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = spawn.popen(
        [sys.executable, "-m", "workers.cli.main", "metrics", "--port", str(port)],
        cwd=ROOT,
        env=base | env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/metrics"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode() if proc.stdout else "exporter exited")
        try:
            return httpx.get(url, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, 15, what="metrics exporter up")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=5)
    assert response.status_code == 200
    return _samples(response.text)


def _submit(session, key: str) -> str:
    return submit(
        session,
        tenant="t1",
        idempotency_key=key,
        action="payments.refund.create",
        args=dict(REFUND_ARGS),
        subject="test",
    ).operation_id


@pytest.mark.postgres
@pytest.mark.redis
def test_ledger_breaker_and_report_figures(pg_ledger, redis_url, tmp_path):
    with pg_ledger.sessions.begin() as s:
        ids = [_submit(s, f"m-{i}") for i in range(7)]

    def move(op_id: str, status: str, **values: object) -> None:
        with pg_ledger.sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id == op_id).values(status=status, **values))

    # 2 not_dispatched stay (one came due 2 minutes ago); 2 outcome_unknown (one submitted 5 minutes ago whose
    # lookup came due 90 s ago, one waiting for a re-check in a minute); 1 succeeded;
    # 1 succeeded long ago (outside the terminal window); 1 reconciliation_required with a handoff.
    move(ids[0], "not_dispatched", next_attempt_at=db_now(-120))
    move(ids[2], "outcome_unknown", created_at=db_now(-300), next_attempt_at=db_now(-90))
    move(ids[3], "outcome_unknown", next_attempt_at=db_now(60))
    move(ids[4], "succeeded", updated_at=db_now(), finished_at=db_now())
    move(ids[5], "succeeded", updated_at=db_now(-7200), finished_at=db_now(-7200))
    move(ids[6], "reconciliation_required")
    with pg_ledger.sessions.begin() as s:
        open_handoff(s, ids[6], reason="lookup budget spent", packet={"operation_id": ids[6]})
        # A person took one over: opened 10 minutes ago, resolved now (takeover 600 s); and one
        # resolved long ago, outside the window.
        for opened_s, resolved_s in ((600, 0), (9000, 8000)):
            done = open_handoff(s, ids[1], reason="earlier", packet={})
            s.execute(
                update(Handoff)
                .where(Handoff.id == done)
                .values(
                    status="resolved",
                    resolution="succeeded",
                    opened_at=db_now(-opened_s),
                    resolved_at=db_now(-resolved_s),
                )
            )

    # A breaker opened through the shared state, exactly as workers would.
    prefix = f"metrics-{os.getpid()}-{time.monotonic_ns()}:"
    actions = tmp_path / "actions.yaml"
    actions.write_text(yaml.safe_dump(actions_doc("http://127.0.0.1:9")))
    shared = BreakerRegistry(
        {"sandbox": BreakerConfig(fail_max=1, reset_timeout_s=300)}, redis_url=redis_url, namespace=prefix
    )
    shared.record(shared.before_call("sandbox"), failure=True)
    shared.close()

    data_dir = tmp_path / "data"  # the report is read from the ledger, whichever host ran it
    finished = dt.datetime.fromtimestamp(1_800_000_000.0, dt.UTC)
    with pg_ledger.sessions.begin() as s:
        report = {
            "since": finished.isoformat(),
            "health": {
                "operations": 400,
                "duplicate_effects": 2,
                "failure_attributability": {"operations": 8, "attributable": 6, "share": 0.75},
                "auto_recovery": {"operations": 0, "recovered": 0, "rate": None},  # nothing to measure
            },
            "discrepancy_count": 3,
            "complete": True,
            "discrepancies": {},
        }
        record_report(s, report, started_at=finished, finished_at=finished, ran_by="test")
    env = {
        "OUTBOX_DATABASE_URL": pg_ledger.url,
        "OUTBOX_DATA_DIR": str(data_dir),
        "OUTBOX_REDIS_URL": redis_url,
        "OUTBOX_BROKER_KEY_PREFIX": prefix,
        "OUTBOX_ACTIONS_FILE": str(actions),
    }
    try:
        with exporter(env) as url:
            m = scrape(url)
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"agent-outbox:breaker:{prefix}*"))
        if keys:  # this test's breaker state only: the shared Redis is never flushed
            client.delete(*keys)

    def ops(status: str) -> float:
        return m[("outbox_operations", (("status", status),))]

    assert m[("outbox_ledger_up", ())] == 1
    assert {
        st: ops(st)
        for st in (
            "not_dispatched",
            "outcome_unknown",
            "reconciliation_required",
            "dispatching",
            "awaiting_approval",
            "committed_evidence_degraded",
        )
    } == {
        "not_dispatched": 2,
        "outcome_unknown": 2,
        "reconciliation_required": 1,
        "dispatching": 0,
        "awaiting_approval": 0,
        "committed_evidence_degraded": 0,
    }
    assert m[("outbox_operations_finished_recent", (("status", "succeeded"),))] == 1  # the old one is outside
    assert m[("outbox_operations_finished_recent", (("status", "failed_before_commit"),))] == 0
    assert m[("outbox_outcome_unknown_backlog", ())] == 2
    assert 299 < m[("outbox_outcome_unknown_oldest_age_seconds", ())] < 400
    assert 119 < m[("outbox_oldest_due_age_seconds", ())] < 200
    # The reconciler's queue (what to scale it on): the due lookup only, not the later re-check.
    assert m[("outbox_lookups_due", ())] == 1
    assert 89 < m[("outbox_oldest_due_lookup_age_seconds", ())] < 190
    assert m[("outbox_handoffs_open", ())] == 1
    assert 0 < m[("outbox_handoffs_oldest_open_age_seconds", ())] < 60
    assert m[("outbox_approvals_pending", ())] == 0 and m[("outbox_approvals_oldest_pending_age_seconds", ())] == 0
    assert m[("outbox_breaker_storage_up", ())] == 1
    assert m[("outbox_breaker_state", (("target", "sandbox"),))] == 2  # open
    assert m[("outbox_report_duplicate_effects", ())] == 2
    assert m[("outbox_report_discrepancies", ())] == 3
    assert m[("outbox_report_last_run_timestamp_seconds", ())] == 1_800_000_000.0
    # The seeds' figures, as the last report measured them; absent where it had nothing to measure.
    assert m[("outbox_report_duplicate_effect_ratio", ())] == 2 / 400
    assert m[("outbox_failure_attributability_ratio", ())] == 0.75
    assert not [k for k in m if k[0] == "outbox_auto_recovery_ratio"]
    # People, over the terminal window: two handoffs opened in it (one still open), one resolved
    # after 600 s; 1 operation ended in it, so 2 of 3 went to a person.
    assert m[("outbox_handoffs_opened_recent", ())] == 2
    assert m[("outbox_handoff_ratio", ())] == 2 / 3
    takeover = {
        dict(labels)["le"]: v for (name, labels), v in m.items() if name == "outbox_handoff_takeover_seconds_bucket"
    }
    assert (takeover["300"], takeover["900"], takeover["+Inf"]) == (0, 1, 1)
    assert m[("outbox_handoff_takeover_seconds_count", ())] == 1
    assert 599 < m[("outbox_handoff_takeover_seconds_sum", ())] < 700
    # Labels are statuses, classes and targets only: never a key, tenant or operation id.
    assert {name for (_, labels) in m for name, _ in labels} <= {"status", "target", "class", "le"}


def test_counters_are_summed_across_processes(tmp_path):
    """Two OS processes record with one PROMETHEUS_MULTIPROC_DIR; the exporter shows the sums."""
    mp = tmp_path / "mp"
    mp.mkdir()
    env = dict(os.environ) | {"PROMETHEUS_MULTIPROC_DIR": str(mp)}
    code = (
        "from workers.ground.metrics import record_attempt, record_retry, record_outcome\n"
        "record_attempt('sandbox', 'succeeded', 0.2)\n"
        "record_attempt('sandbox', 'not_processed', 0.05)\n"
        "record_retry('sandbox', 3.0, 2.0)\n"
        "record_outcome('succeeded')\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env) for _ in range(2)]
    assert [p.wait(30) for p in procs] == [0, 0]
    assert len(list(mp.glob("*.db"))) >= 2  # one file per process and metric type

    # The ledger part points at an empty embedded ledger here: only the process sums matter.
    with exporter(
        {
            "PROMETHEUS_MULTIPROC_DIR": str(mp),
            "OUTBOX_DATA_DIR": str(tmp_path / "data"),
            "OUTBOX_DATABASE_URL": "",
            "OUTBOX_REDIS_URL": "",
        }
    ) as url:
        m = scrape(url)
    assert m[("outbox_ledger_up", ())] == 1  # the SQLite side of the same queries
    assert m[("outbox_outcome_unknown_backlog", ())] == 0
    assert m[("outbox_lookups_due", ())] == 0 and m[("outbox_oldest_due_lookup_age_seconds", ())] == 0
    assert m[("outbox_attempts_total", (("class", "succeeded"), ("target", "sandbox")))] == 2
    assert m[("outbox_attempts_total", (("class", "not_processed"), ("target", "sandbox")))] == 2
    assert m[("outbox_attempt_latency_seconds_count", (("class", "succeeded"), ("target", "sandbox")))] == 2
    assert m[("outbox_retry_delay_seconds_count", (("target", "sandbox"),))] == 2
    assert m[("outbox_retry_after_seconds_sum", (("target", "sandbox"),))] == 4.0
    assert m[("outbox_outcomes_total", (("status", "succeeded"),))] == 2


def test_a_real_worker_records_attempts_outcomes_and_retry_after(pipe, sandbox, tmp_path):
    """A real Celery worker process writes to the multiprocess dir; the exporter reads the sums."""
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    pipe.env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)  # the relay thread records too
    try:
        sandbox.add_fault(mode="unavailable_503", method="POST", count=1, retry_after_s=30)
        pipe.start_worker()
        pipe.start_relay()
        op_id = pipe.submit("k-metrics").operation_id
        pipe.wait_attempt_done(op_id, 1)
        pipe.advance_to_due(op_id)  # the Retry-After runs out
        pipe.wait_status(op_id, "succeeded")
        with exporter(pipe.env) as url:
            samples = wait_for(
                lambda: (s := scrape(url)).get(("outbox_outcomes_total", (("status", "succeeded"),))) and s,
                15,
                what="outcome counted",
            )
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    assert samples[("outbox_attempts_total", (("class", "not_processed"), ("target", "sandbox")))] == 1
    assert samples[("outbox_attempts_total", (("class", "succeeded"), ("target", "sandbox")))] == 1
    assert samples[("outbox_retry_after_seconds_count", (("target", "sandbox"),))] == 1
    assert samples[("outbox_outcomes_total", (("status", "not_dispatched"),))] == 1
    # Attempt 2 reached the provider again: a retry the provider bills.
    assert samples[("outbox_retry_billed_calls_total", (("target", "sandbox"),))] == 1


def test_the_api_counts_requests_by_route_template_and_status(ledger, tmp_path):
    from fastapi.testclient import TestClient

    from outbox.settings import Settings
    from workers.ground.metrics import PROCESS_REGISTRY
    from workers.server.app import create_app

    def count(labels: tuple[tuple[str, str], ...]) -> float:
        return PROCESS_REGISTRY.get_sample_value("outbox_http_requests_total", dict(labels)) or 0.0

    one_op = (("method", "GET"), ("route", "/v1/operations/{operation_id}"), ("status", "401"))
    before = count(one_op)
    settings = Settings(database_url=ledger.url, data_dir=tmp_path)
    with TestClient(create_app(settings), base_url="http://localhost") as client:
        for op in ("op-1", "op-2"):  # no key: 401, each under the route's template
            assert client.get(f"/v1/operations/{op}").status_code == 401
        assert client.get("/healthz").status_code == 200
        assert client.get("/no/such/path").status_code == 404
        text = client.get("/metrics").text
    m = _samples(text)
    assert m[("outbox_http_requests_total", one_op)] - before == 2
    assert m[("outbox_http_requests_total", (("method", "GET"), ("route", "/healthz"), ("status", "200")))] >= 1
    assert m[("outbox_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404")))] >= 1
    assert m[("outbox_http_request_duration_seconds_count", (("method", "GET"), ("route", "/healthz")))] >= 1
    assert not [k for k in m if "op-1" in str(k)], "an id never becomes a label"


def test_per_tenant_due_age_is_opt_in_and_bounded_to_the_tenants_waiting_longest(ledger):
    """OUTBOX_METRICS_TENANTS: the oldest due age of that many tenants, those waiting longest; none by default."""
    from prometheus_client import CollectorRegistry, generate_latest

    from outbox.reads.metrics import LedgerCollector

    for tenant, due_s in (("acme", 300), ("globex", 200), ("initech", 100), ("later", -60)):
        with ledger.sessions.begin() as s:
            r = submit(
                s, tenant=tenant, idempotency_key="k", action="payments.refund.create", args=REFUND_ARGS, subject="x"
            )
        with ledger.sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id == r.operation_id).values(next_attempt_at=db_now(-due_s)))

    def scrape(tenants: int) -> dict[str, float]:
        registry = CollectorRegistry()
        registry.register(LedgerCollector(ledger.engine, tenants=tenants))
        m = _samples(generate_latest(registry).decode())
        return {
            dict(labels)["tenant"]: v
            for (name, labels), v in m.items()
            if name == "outbox_tenant_oldest_due_age_seconds"
        }

    assert scrape(0) == {}  # no tenant label unless the operator asks for it
    ages = scrape(2)
    assert set(ages) == {"acme", "globex"}  # the two waiting longest; initech left out, "later" not due
    assert 299 < ages["acme"] < 400 and 199 < ages["globex"] < 300
