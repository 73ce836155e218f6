"""Handoffs as cases, on SQLite and PostgreSQL: an owner, re-checks that the provider's answer settles,
a person's decision and a re-check that never both win, "abandoned" as an end, "retry as a new intent"
linked both ways, and the unowned gauge. The workers and the provider are played by the ledger calls
they make; tests/integration/reconcile/test_handoff_cases.py runs the same through the real pipeline.
"""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from outbox.errors import InvalidIntent
from outbox.evidence import rechecks
from outbox.evidence.checks import Recheck, RecheckTerms
from outbox.evidence.handoffs import open_handoff
from outbox.evidence.settlement import settle_if_fenced
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.claims import Claim, claim_due, claim_unknown
from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Handoff, Operation
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.reads.metrics import LedgerCollector
from outbox.service import handoffs
from outbox.testing import advance_ledger_clock
from producer import submit

ACTION = "payments.refund.create"
SINK = EvidenceSink(None)
ARGS = {"order_id": "o-1", "amount": Decimal("25.00"), "currency": "EUR"}
TERMS = RecheckTerms(first_s=60, max_s=3600, without_keys_s=86400)
PLAN = Recheck(first_s=60, horizon_s=86400)  # a first check after a minute, for a day


def _handed_over(ledger: Any, key: str = "r-1", *, recheck: Recheck | None = PLAN) -> tuple[str, int]:
    """An operation whose attempt was ambiguous and whose lookups could not settle it: with a person."""
    with ledger.sessions.begin() as s:
        receipt = submit(s, tenant="acme", idempotency_key=key, action=ACTION, args=dict(ARGS), subject="agent:bot")
    with ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="w1", lease_s=30)
        finalize_if_fenced(
            s, c, AttemptReport(AttemptClass.AMBIGUOUS, error="reset"), to=Status.OUTCOME_UNKNOWN, reason="reset"
        )
    with ledger.sessions.begin() as s:
        [c] = claim_unknown(s, worker="r1", lease_s=30)
        report = AttemptReport(AttemptClass.AMBIGUOUS, status_code=503, error="lookup down")
        settle_if_fenced(s, c, report, to=Status.RECONCILIATION_REQUIRED, reason="lookup down; budget spent")
        hid = open_handoff(s, c.operation_id, reason="lookup down; budget spent", packet={}, recheck=recheck)
    return receipt.operation_id, hid


def _handoff(ledger: Any, hid: int) -> Handoff:
    with ledger.sessions() as s:
        h = s.get(Handoff, hid)
        assert h is not None
        return h


def _op(ledger: Any, op_id: str) -> Operation:
    with ledger.sessions() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        return op


def _recheck(ledger: Any) -> Claim:
    with ledger.sessions.begin() as s:
        [c] = rechecks.claim_rechecks(s, worker="r2", lease_s=30, limit=5)
    assert c.status is Status.RECONCILIATION_REQUIRED and c.kind.value == "lookup"
    return c


def _events(ledger: Any, op_id: str) -> list[Any]:
    with ledger.sessions() as s:
        stmt = select(HistoryEvent).where(HistoryEvent.operation_id == op_id).order_by(HistoryEvent.at, HistoryEvent.id)
        return list(s.execute(stmt).scalars())


def test_a_case_has_a_next_check_and_is_claimed_only_when_due(ledger):
    op_id, hid = _handed_over(ledger)
    h = _handoff(ledger, hid)
    assert h.next_check_at is not None and h.checks_until is not None and h.owner is None
    with ledger.sessions.begin() as s:
        assert rechecks.claim_rechecks(s, worker="r2", lease_s=30, limit=5) == []  # a minute away
    assert rechecks.due_rechecks(ledger.engine, limit=5) == []
    advance_ledger_clock(ledger.engine, 61, operation_ids=[op_id])
    assert rechecks.due_rechecks(ledger.engine, limit=5) == [op_id]
    c = _recheck(ledger)
    with ledger.sessions.begin() as s:  # held: a second reconciler finds nothing
        assert rechecks.claim_rechecks(s, worker="r3", lease_s=30, limit=5) == []
    # Nothing found: the case stays with its person, the next check further away than the first.
    with ledger.sessions.begin() as s:
        moved, at = rechecks.settle_open(
            s,
            c,
            AttemptReport(AttemptClass.AMBIGUOUS, status_code=503),
            reason="lookup down",
            terms=TERMS,
            rng=random.Random(1),
        )
    assert moved and at is not None
    op, h = _op(ledger, op_id), _handoff(ledger, hid)
    assert op.status == "reconciliation_required" and op.lease_owner is None and h.status == "open"
    assert h.next_check_at is not None
    assert [e.event for e in _events(ledger, op_id)][-2:] == ["reconcile claim", "re-check"]


def test_a_handoff_for_a_decision_is_not_rechecked(ledger):
    op_id, hid = _handed_over(ledger, recheck=None)
    advance_ledger_clock(ledger.engine, 10 * 86400, operation_ids=[op_id])
    assert _handoff(ledger, hid).next_check_at is None
    assert rechecks.due_rechecks(ledger.engine, limit=5) == []


def test_a_recheck_that_finds_it_resolves_the_case_by_the_providers_evidence(ledger):
    op_id, hid = _handed_over(ledger)
    advance_ledger_clock(ledger.engine, 61, operation_ids=[op_id])
    c = _recheck(ledger)
    found = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_9", response_digest="d" * 64)
    with ledger.sessions.begin() as s:
        assert (
            rechecks.settle_found(s, c, found, to=Status.SUCCEEDED, reason="found at the provider", sink=SINK)
            is Status.SUCCEEDED
        )
    op, h = _op(ledger, op_id), _handoff(ledger, hid)
    assert op.status == "succeeded" and op.result_reference == "re_9" and op.fencing_token == c.fencing_token
    assert (h.status, h.resolution, h.resolved_by, h.evidence_attempt_id) == (
        "resolved",
        "succeeded",
        "r2",
        c.attempt_id,
    )
    assert h.next_check_at is None and "resolved by the provider's evidence" in (h.note or "")
    last = _events(ledger, op_id)[-1]
    assert (last.event, last.from_status, last.to_status) == (
        "resolved by the provider's evidence",
        "reconciliation_required",
        "succeeded",
    )
    # The person came too late: the case is closed, and says by what.
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="by the provider's evidence"):
        handoffs.resolve(s, "acme", hid, resolution="abandoned", by="alice", note="gave up")


def test_a_persons_decision_fences_off_a_recheck_in_flight(ledger):
    op_id, hid = _handed_over(ledger)
    advance_ledger_clock(ledger.engine, 61, operation_ids=[op_id])
    c = _recheck(ledger)  # the lookup is out
    with ledger.sessions.begin() as s:
        assert (
            handoffs.resolve(s, "acme", hid, resolution="abandoned", by="alice", note="nobody can tell")
            is Status.ABANDONED
        )
    found = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_9")
    with ledger.sessions.begin() as s:
        assert rechecks.settle_found(s, c, found, to=Status.SUCCEEDED, reason="found", sink=SINK) is None
    op, h = _op(ledger, op_id), _handoff(ledger, hid)
    assert op.status == "abandoned" and op.finished_at is not None and op.fencing_token == c.fencing_token + 1
    assert (h.resolution, h.resolved_by, h.evidence_attempt_id, h.next_check_at) == ("abandoned", "alice", None, None)
    with ledger.sessions() as s:  # the lookup's answer is kept, marked stale: the late-success sweep applies it
        from outbox.evidence.late_successes import unapplied

        assert [u.attempt_id for u in unapplied(s, operation_ids=[op_id])] == [c.attempt_id]


def test_abandoned_is_an_end_that_the_providers_confirmation_still_settles(ledger):
    from outbox.evidence.late_successes import apply_unapplied

    op_id, hid = _handed_over(ledger)
    advance_ledger_clock(ledger.engine, 61, operation_ids=[op_id])
    c = _recheck(ledger)
    with ledger.sessions.begin() as s:
        handoffs.resolve(s, "acme", hid, resolution="abandoned", by="alice", note="nobody can tell")
    with ledger.sessions.begin() as s:
        rechecks.settle_found(
            s,
            c,
            AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_9"),
            to=Status.SUCCEEDED,
            reason="found",
            sink=SINK,
        )
    assert rechecks.due_rechecks(ledger.engine, limit=5) == []  # an abandoned case is looked up no more
    moved = apply_unapplied(ledger.sessions, actor="sweep", sink=SINK, packet=lambda s, o, w: {})
    assert moved == {op_id: Status.SUCCEEDED} and _op(ledger, op_id).result_reference == "re_9"


def test_taking_a_case_is_an_identity_and_taking_it_over_is_explicit(ledger):
    op_id, hid = _handed_over(ledger)
    with ledger.sessions.begin() as s:
        row = handoffs.take(s, "acme", hid, identity="key:7")
        assert row.handoff.owner == "key:7" and row.handoff.taken_at is not None
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="owned by key:7"):
        handoffs.take(s, "acme", hid, identity="cli:bob")
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="owned by key:7"):
        handoffs.release(s, "acme", hid, identity="cli:bob")
    with ledger.sessions.begin() as s:
        assert handoffs.take(s, "acme", hid, identity="cli:bob", over=True).handoff.owner == "cli:bob"
    with ledger.sessions.begin() as s:
        assert handoffs.release(s, "acme", hid, identity="cli:bob").handoff.owner is None
    with ledger.sessions.begin() as s, pytest.raises(Exception, match="no handoff"):
        handoffs.take(s, "other-tenant", hid, identity="key:9")
    taken = [(e.event, e.actor, e.reason) for e in _events(ledger, op_id) if e.event.startswith("handoff")]
    assert taken == [
        ("handoff taken", "key:7", f"handoff {hid} taken by key:7"),
        ("handoff taken", "cli:bob", f"handoff {hid} taken by cli:bob from key:7"),
        ("handoff released", "cli:bob", f"handoff {hid} released by cli:bob"),
    ]
    assert _op(ledger, op_id).status == "reconciliation_required"  # taking moves nothing


def test_retry_as_a_new_intent_links_both_ways_under_a_derived_key(ledger):
    op_id, hid = _handed_over(ledger)
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="--note"):
        handoffs.resolve(s, "acme", hid, resolution="retry-as-new-intent", by="alice", note=" ")
    with ledger.sessions.begin() as s:
        assert (
            handoffs.resolve(s, "acme", hid, resolution="abandoned", by="alice", note="nobody can tell")
            is Status.ABANDONED
        )
    # Abandoned: a person may still turn it into a new task.
    with ledger.sessions.begin() as s:
        status = handoffs.resolve(
            s,
            "acme",
            hid,
            resolution="retry-as-new-intent",
            by="bob",
            note="provider support: no such refund",
            identity="key:3",
        )
    assert status is Status.ABANDONED
    old = _op(ledger, op_id)
    new = _op(ledger, old.retried_as or "")
    assert new.retry_of == op_id and new.idempotency_key == "r-1:retry-1" and new.provider_key == "acme:r-1:retry-1"
    assert new.status == "not_dispatched" and new.args_digest == old.args_digest and new.subject == old.subject
    assert new.submitted_by == "key:3"  # sent in the name of the person who retried it
    h = _handoff(ledger, hid)
    assert h.resolution == "retry-as-new-intent" and h.resolved_by == "bob (key:3)" and new.id in (h.note or "")
    ev = [e for e in _events(ledger, op_id) if e.event == "resolved: retried as a new intent"]
    assert len(ev) == 1 and (ev[0].from_status, ev[0].to_status) == ("abandoned", "abandoned")
    assert "on the word of the person" in (ev[0].reason or "")  # the ambiguous attempt was never proven absent
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="resolved as retry-as-new-intent"):
        handoffs.resolve(s, "acme", hid, resolution="retry-as-new-intent", by="carol", note="again")


def test_no_retry_as_a_new_intent_when_the_provider_confirmed_the_effect(ledger):
    op_id, hid = _handed_over(ledger)
    advance_ledger_clock(ledger.engine, 61, operation_ids=[op_id])
    c = _recheck(ledger)
    with ledger.sessions.begin() as s:
        handoffs.resolve(s, "acme", hid, resolution="abandoned", by="alice", note="nobody can tell")
    with ledger.sessions.begin() as s:  # the re-check's confirmation lands on record, refused as stale
        rechecks.settle_found(
            s,
            c,
            AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_9"),
            to=Status.SUCCEEDED,
            reason="found",
            sink=SINK,
        )
    with ledger.sessions.begin() as s, pytest.raises(InvalidIntent, match="confirmed an effect"):
        handoffs.resolve(s, "acme", hid, resolution="retry-as-new-intent", by="bob", note="try again")
    with ledger.sessions() as s:
        assert s.execute(select(Operation.id).where(Operation.retry_of == op_id)).first() is None


def test_unowned_cases_rise_past_the_setting_per_tenant_and_target(ledger):
    op_id, hid = _handed_over(ledger)

    def unowned() -> dict[tuple[str, str], float]:
        registry = CollectorRegistry()
        registry.register(LedgerCollector(ledger.engine, unowned_after_s=1800, targets={ACTION: "payments"}))
        return {
            (s.labels["tenant"], s.labels["target"]): s.value
            for m in registry.collect()
            if m.name == "outbox_handoffs_unowned"
            for s in m.samples
        }

    assert unowned() == {}
    advance_ledger_clock(ledger.engine, 1801, operation_ids=[op_id])
    assert unowned() == {("acme", "payments"): 1.0}
    with ledger.sessions.begin() as s:
        handoffs.take(s, "acme", hid, identity="key:7")
    assert unowned() == {}


def test_the_operator_api_takes_a_case_and_retries_it_as_a_new_intent(ledger, tmp_path):
    from fastapi.testclient import TestClient

    from outbox.access.keys import create_key
    from outbox.settings import Settings
    from workers.server.app import create_app

    op_id, hid = _handed_over(ledger)
    with ledger.sessions.begin() as s:
        ops, _ = create_key(s, tenant="acme", scopes=["operate"])
        other, _ = create_key(s, tenant="acme", scopes=["operate"])
        agent, _ = create_key(s, tenant="acme", scopes=["submit", "read"])
    app = create_app(Settings(database_url=ledger.url, data_dir=tmp_path))
    with TestClient(app, base_url="http://localhost") as api:

        def as_(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        taken = api.post(f"/v1/handoffs/{hid}/take", headers=as_(ops))
        assert taken.status_code == 200, taken.text
        owner = taken.json()["owner"]
        assert owner.startswith("key:") and taken.json()["next_check_at"] and taken.json()["retried_as"] is None
        assert api.post(f"/v1/handoffs/{hid}/take", headers=as_(other)).status_code == 422  # owned: say --over
        over = api.post(f"/v1/handoffs/{hid}/take", headers=as_(other), json={"over": True})
        assert over.status_code == 200 and over.json()["owner"] != owner
        assert api.get("/v1/handoffs", headers=as_(ops)).json()["handoffs"][0]["owner"] == over.json()["owner"]
        body = {"as": "retry-as-new-intent", "by": "ada", "note": "provider support: nothing under the old key"}
        assert api.post(f"/v1/handoffs/{hid}/resolve", headers=as_(agent), json=body).status_code == 403
        done = api.post(f"/v1/handoffs/{hid}/resolve", headers=as_(ops), json=body)
        assert done.status_code == 200, done.text
        doc = done.json()
        assert (
            doc["operation_status"] == "abandoned" and doc["resolution"] == "retry-as-new-intent" and doc["retried_as"]
        )
        new = api.get(f"/v1/operations/{doc['retried_as']}", headers=as_(agent))
        assert new.status_code == 200 and new.json()["retry_of"] == op_id, new.text
        old = api.get(f"/v1/operations/{op_id}", headers=as_(agent)).json()
        assert old["retried_as"] == doc["retried_as"] and old["outcome"] == "ABANDONED"
        assert "A person retried it as a new intent" in old["model_message"]


def test_a_failure_webhook_for_a_rechecked_case_makes_its_recheck_due_now(ledger):
    import datetime as dt

    from outbox.actions.webhooks import WebhookOutcome
    from outbox.evidence.webhooks import EventReading, ReceivedEvent, receive

    op_id, hid = _handed_over(ledger)
    assert rechecks.due_rechecks(ledger.engine, limit=5) == []
    event = ReceivedEvent(
        target="payments",
        scope=None,
        event_id="evt_9",
        event_type="refund.failed",
        scheme="standard",
        signed_at=dt.datetime.now(dt.UTC),
        body_digest="b" * 64,
        readings=[EventReading(ACTION, WebhookOutcome.FAILED, "acme:r-1", "re_1", {"id": "re_1", "status": "failed"})],
    )
    with ledger.sessions.begin() as s:
        got = receive(s, event, actor="webhook:payments", sink=SINK, packet=lambda s, o, w: {})
    assert got.operation_id == op_id and got.moved_to is None and "re-checked now" in got.note
    assert rechecks.due_rechecks(ledger.engine, limit=5) == [op_id]  # the lookup reads what the provider holds
    assert _op(ledger, op_id).status == "reconciliation_required" and _handoff(ledger, hid).status == "open"
