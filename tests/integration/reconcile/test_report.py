"""``agent-outbox report``: the ledger compared with the sandbox's listing, as a subprocess.

Discrepancies are planted for real at the provider: a refund POSTed directly with a key the ledger
does not know (document without record), the same key POSTed again while the provider ignores
keys (duplicate), and a provider that lost its objects (records without documents).
"""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from tests.harness import REFUND_ARGS, action, actions_doc, pk
from tests.integration.surfaces.test_handoffs_cli import cli
from workers.cli.report import parse_since

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LISTING = {
    "request": {"method": "GET", "path": "/v1/refunds", "query": {"created_after": "{since}"}},
    "items_field": "data",
    "cursor_param": "starting_after",
    "cursor_from_last_item": "id",
    "has_more_field": "has_more",
    "page_size_param": "limit",
    "page_size": 2,  # small pages: the report must follow the cursor
}


def report(pipe, *extra: str):
    import json

    done = cli(pipe, "report", "--json", *extra)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def plant(sandbox, key: str) -> str:
    r = httpx.post(f"{sandbox.url}/v1/refunds", json=REFUND_ARGS, headers={"Idempotency-Key": key}, timeout=5)
    r.raise_for_status()
    return str(r.json()["id"])


def test_report_finds_planted_duplicate_and_orphan(pipe, sandbox):
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={
                "payments.refund.create": action("/v1/refunds", decimal_args=["amount"], **{"list": LISTING}),
                "support.ticket.create": action("/v1/tickets"),
            },
        )
    )
    sandbox.add_fault(mode="unavailable_503", method="POST", key_pattern=pk("rep-3"), count=1)
    pipe.start_worker()
    pipe.start_relay()
    ids = [pipe.submit(f"rep-{i}").operation_id for i in range(1, 4)]
    for op_id in ids:
        pipe.wait_status(op_id, "succeeded")

    rc, clean = report(pipe)
    assert rc == 0, clean["discrepancies"]
    assert clean["discrepancy_count"] == 0 and clean["complete"]
    assert clean["listings"][0]["documents"] == 3 and clean["listings"][0]["pages"] >= 2
    assert clean["actions_without_listing"] == ["support.ticket.create"]
    health = clean["health"]
    assert health["operations"] == 3 and health["duplicate_effects"] == 0
    assert health["auto_recovery"] == {"operations": 1, "recovered": 1, "rate": 1.0}
    assert health["retries_by_target"] == {"sandbox": {"retries": 1, "billable": 1}}
    assert health["handoffs"]["open"] == 0 and health["failure_attributability"]["share"] is None
    human = cli(pipe, "report")
    assert human.returncode == 0 and "auto-recovery rate" in human.stdout

    orphan = plant(sandbox, "rep-orphan")  # a refund nobody in the ledger asked for
    sandbox.configure(idempotency=False)
    second = plant(sandbox, pk("rep-1"))  # the provider ignores the key: a second refund for rep-1
    rc, found = report(pipe, "--since", "1h")
    assert rc == 1
    d = found["discrepancies"]
    assert [(x["idempotency_key"], x["reference"], x["why"]) for x in d["document_without_record"]] == [
        ("rep-orphan", orphan, "no operation with this key")
    ]
    assert len(d["duplicates"]) == 1
    dup = d["duplicates"][0]
    assert (
        dup["idempotency_key"] == pk("rep-1")
        and dup["tenant"] == "t1"
        and dup["count"] == 2
        and second in dup["references"]
    )
    assert d["record_without_document"] == []
    assert found["health"]["duplicate_effects"] == 1 and found["discrepancy_count"] == 2
    human = cli(pipe, "report", "--since", "1h")
    assert human.returncode == 1 and "rep-orphan" in human.stdout

    # The provider lost everything: each success is now a record without a document.
    sandbox.reset()
    rc, lost = report(pipe)
    assert rc == 1
    assert sorted(x["operation_id"] for x in lost["discrepancies"]["record_without_document"]) == sorted(ids)

    # Bad input: exit 2.
    bad = cli(pipe, "report", "--since", "yesterday")
    assert bad.returncode == 2 and "--since" in bad.stderr


def test_since_accepts_durations_and_timestamps():
    now = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    assert parse_since("24h", now=now) == now - dt.timedelta(hours=24)
    assert parse_since("30m", now=now) == now - dt.timedelta(minutes=30)
    assert parse_since("2026-11-29T10:00:00Z", now=now) == now - dt.timedelta(hours=2)
    assert parse_since("2026-11-29T10:00:00", now=now) == now - dt.timedelta(hours=2)


def test_beat_s_report_runs_in_a_worker_and_is_kept_in_the_ledger_for_every_reader(pipe, sandbox):
    """The hourly ``outbox.report`` task, sent as beat sends it to a real worker, records the report
    in the ledger; the CLI's run is recorded too, and the API reads the last one (its tenant's part)."""
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from outbox.access.keys import create_key
    from outbox.ledger.models import ReportRun
    from workers.server.app import create_app
    from workers.wiring.celery_app import REPORT_TASK, make_app

    pipe.write_actions(
        actions_doc(sandbox.url, actions={"payments.refund.create": action("/v1/refunds", **{"list": LISTING})})
    )
    pipe.start_worker()
    pipe.start_relay()
    pipe.wait_status(pipe.submit("rep-beat").operation_id, "succeeded")
    plant(sandbox, "rep-orphan")  # a document no operation claims: a finding of tenant "(unknown)"
    make_app(pipe.settings()).send_task(REPORT_TASK)

    def kept() -> list[ReportRun]:
        with pipe.sessions() as s:
            return list(s.execute(select(ReportRun).order_by(ReportRun.id)).scalars())

    from tests.harness import wait_for

    [beat] = wait_for(kept, 30, what="the beat report kept in the ledger")
    assert beat.ran_by == "beat" and beat.complete and beat.discrepancies == 1
    assert beat.findings["document_without_record"][0]["idempotency_key"] == "rep-orphan"
    rc, _ = report(pipe)
    assert rc == 1 and [r.ran_by for r in kept()] == ["beat", "cli"]

    with pipe.sessions.begin() as s:
        key, _ = create_key(s, tenant="t1", scopes=["operate"])
    with TestClient(create_app(pipe.settings())) as api:
        latest = api.get("/v1/reports/latest", headers={"Authorization": f"Bearer {key}"})
    assert latest.status_code == 200, latest.text
    doc = latest.json()
    assert doc["ran_by"] == "cli" and doc["complete"] is True
    assert doc["discrepancy_count"] == 0 and doc["discrepancies"]["document_without_record"] == []  # not t1's
