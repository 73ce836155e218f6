"""Handoffs that keep working (issue 51, 2), through the real pipeline: relay, Celery workers,
PostgreSQL, Redis and the sandbox over HTTP. A person drives the CLI and the console as they would;
effects are counted by the sandbox. The reconciler's back-off and the cases' slow schedule are not
waited for: the tests move the ledger's clock to each due time.
"""

from __future__ import annotations

import getpass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from outbox.access.keys import create_key
from outbox.evidence.rechecks import due_rechecks
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import Handoff
from outbox.reads.metrics import LedgerCollector
from tests.harness import CLOCK_LEASE, pk, wait_for
from tests.integration.surfaces.test_handoffs_cli import cli, cli_json
from workers.server.app import create_app

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
ME = f"cli:{getpass.getuser()}"


def _handoff(pipe: Any, op_id: str) -> Handoff:
    with pipe.sessions() as s:
        return s.execute(select(Handoff).where(Handoff.operation_id == op_id)).scalar_one()


def _to_next_check(pipe: Any, op_id: str) -> None:
    """Move this operation's clock to its handoff's next check (the relay then rings the reconciler)."""
    with pipe.sessions() as s:
        due, now = s.execute(select(Handoff.next_check_at, db_now()).where(Handoff.operation_id == op_id)).one()
    left = (as_utc(due) - as_utc(now)).total_seconds()  # type: ignore[operator]
    pipe.advance_ledger_clock(max(left, 0.0) + 0.001, operation_ids=[op_id])


def _unowned(pipe: Any) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    collector = LedgerCollector(
        pipe.sessions.kw["bind"], unowned_after_s=1800, targets={"payments.refund.create": "sandbox"}
    )
    registry.register(collector)
    return {
        (s.labels["tenant"], s.labels["target"]): s.value
        for m in registry.collect()
        if m.name == "outbox_handoffs_unowned"
        for s in m.samples
    }


def _handed_over_in_an_outage(pipe: Any, sandbox: Any, key: str, post_fault: str) -> str:
    """The provider's answer lost, then its lookup down (503) until the reconciler's budget is spent."""
    sandbox.add_fault(mode=post_fault, method="POST", count=1, key_pattern=pk(key))
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "2"})
    pipe.start_worker()
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id
    pipe.wait_attempt_done(op_id, 1)
    for n in (1, 2):
        pipe.advance_to_due(op_id)
        assert pipe.wait_attempt_done(op_id, n, kind="lookup").status_code == 503
    pipe.wait_status(op_id, "reconciliation_required")
    return op_id


def test_a_handoff_made_in_an_outage_resolves_itself_when_the_provider_answers_again(pipe, sandbox):
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    op_id = _handed_over_in_an_outage(pipe, sandbox, "hc-outage", "commit_then_drop")  # the effect made
    first = _handoff(pipe, op_id)
    assert first.status == "open" and first.owner is None and first.next_check_at is not None
    assert 55 <= (as_utc(first.next_check_at) - as_utc(first.opened_at)).total_seconds() <= 61  # type: ignore[operator]
    assert _unowned(pipe) == {}

    # Half an hour later nobody has taken it: the gauge says so. Its re-checks went on meanwhile: the
    # lookup still down, the case stays with a person and its next check moves further out.
    pipe.advance_ledger_clock(1801, operation_ids=[op_id])
    assert _unowned(pipe) == {("t1", "sandbox"): 1.0}
    assert pipe.wait_attempt_done(op_id, 3, kind="lookup").status_code == 503
    later = wait_for(
        lambda: (h := _handoff(pipe, op_id)).next_check_at != first.next_check_at and h, 15, what="rescheduled"
    )
    assert pipe.op(op_id).status == "reconciliation_required" and later.status == "open"
    assert (as_utc(later.next_check_at) - as_utc(later.opened_at)).total_seconds() > 3000  # type: ignore[operator]

    # A person takes it (CLI); the owner and the next check show in the CLI and the console.
    taken = cli(pipe, "handoffs", "take", str(first.id))
    assert taken.returncode == 0 and ME in taken.stdout, taken.stderr
    [listed] = cli_json(pipe, "handoffs", "list")
    assert listed["owner"] == ME and listed["next_check_at"] and listed["taken_at"]
    shown = cli(pipe, "handoffs", "show", str(first.id))
    assert f"owner {ME}" in shown.stdout and "next check 20" in shown.stdout, shown.stdout
    table = cli(pipe, "handoffs", "list")
    assert ME in table.stdout and "next_check_at" in table.stdout
    assert _unowned(pipe) == {}
    with pipe.sessions.begin() as s:
        key, _ = create_key(s, tenant="t1", scopes=["operate"])
    with TestClient(create_app(pipe.settings()), base_url="http://localhost") as console:
        assert console.post("/console/login", data={"key": key}, follow_redirects=False).status_code == 303
        page = console.get("/console/handoffs").text
        assert ME in page and "Take over" in page and "next check" in page and "none: a person decides" not in page

    # The provider answers again: the next re-check finds the effect, and the case closes itself.
    sandbox.remove_fault(down["id"])
    _to_next_check(pipe, op_id)
    op = pipe.wait_status(op_id, "succeeded", timeout_s=20)
    effects = sandbox.effects(key=pk("hc-outage"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    assert len(sandbox.requests(method="POST", key=pk("hc-outage"))) == 1  # nothing was sent again
    [closed] = cli_json(pipe, "handoffs", "list", "--all")
    assert closed["status"] == "resolved" and closed["resolution"] == "succeeded" and closed["resolved_by_evidence"]
    assert closed["next_check_at"] is None and closed["owner"] == ME
    history = cli_json(pipe, "ops", "show", op_id)["history"]
    [ev] = [e for e in history if e["event"] == "resolved by the provider's evidence"]
    assert (ev["from"], ev["to"]) == ("reconciliation_required", "succeeded")
    assert "lookup 4 succeeded" in ev["reason"] and "found at the provider" in ev["reason"]
    assert due_rechecks(pipe.sessions.kw["bind"], limit=5) == []


def test_an_abandoned_case_is_retried_as_a_new_intent_only_by_a_person(pipe, sandbox):
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    op_id = _handed_over_in_an_outage(pipe, sandbox, "hc-retry", "drop_before_commit")  # nothing made
    hid = _handoff(pipe, op_id).id
    gave_up = cli(
        pipe, "handoffs", "resolve", str(hid), "--as", "abandoned", "--by", "alice", "--note", "nobody can tell"
    )
    assert gave_up.returncode == 0 and "abandoned" in gave_up.stdout, gave_up.stderr
    assert pipe.op(op_id).status == "abandoned"
    # Abandoned is an end: nothing looks it up again nor sends anything, however long it waits.
    sandbox.remove_fault(down["id"])
    pipe.advance_ledger_clock(2 * 86400, operation_ids=[op_id])
    assert _handoff(pipe, op_id).next_check_at is None and due_rechecks(pipe.sessions.kw["bind"], limit=5) == []
    assert pipe.count() == 1 and pipe.op(op_id).status == "abandoned"

    # Only a person turns it into a new task: an agent's key may not.
    with pipe.sessions.begin() as s:
        agent_key, _ = create_key(s, tenant="t1", scopes=["submit", "read"])
    with TestClient(create_app(pipe.settings()), base_url="http://localhost") as api:
        body = {"as": "retry-as-new-intent", "by": "bot", "note": "again"}
        refused = api.post(f"/v1/handoffs/{hid}/resolve", json=body, headers={"Authorization": f"Bearer {agent_key}"})
        assert refused.status_code == 403, refused.text
    assert pipe.count() == 1

    retried = cli(
        pipe, "handoffs", "resolve", str(hid), "--as", "retry-as-new-intent", "--by", "bob",
        "--note", "provider support: no refund under the old key",
    )  # fmt: skip
    assert retried.returncode == 0, retried.stderr
    new_id = pipe.op(op_id).retried_as
    assert new_id and new_id in retried.stdout
    new = pipe.wait_status(new_id, "succeeded", timeout_s=20)
    assert new.idempotency_key == "hc-retry:retry-1" and new.provider_key == pk("hc-retry:retry-1")
    effects = sandbox.effects(key=pk("hc-retry:retry-1"))
    assert len(effects) == 1 and new.result_reference == effects[0]["object_id"]
    assert sandbox.effects(key=pk("hc-retry")) == []  # the old key: nothing, before or after
    assert len(sandbox.requests(method="POST", key=pk("hc-retry"))) == 1

    # Linked both ways, in ops show and in the handoff.
    old_doc, new_doc = cli_json(pipe, "ops", "show", op_id), cli_json(pipe, "ops", "show", new_id)
    assert (old_doc["status"], old_doc["retried_as"], new_doc["retry_of"]) == ("abandoned", new_id, op_id)
    [case] = cli_json(pipe, "handoffs", "list", "--all")
    assert case["resolution"] == "retry-as-new-intent" and case["retried_as"] == new_id
    assert f"retry of {op_id}" in cli(pipe, "ops", "show", new_id).stdout
    [ev] = [e for e in old_doc["history"] if e["event"] == "resolved: retried as a new intent"]
    assert ev["actor"].startswith("bob (cli:") and "hc-retry:retry-1" in ev["reason"]
