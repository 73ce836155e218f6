"""A provider's webhook event as evidence, on SQLite and PostgreSQL (outbox/evidence/webhooks.py): it
settles its operation exactly as a lookup's answer or a late success does, fenced, once per event id.

The workers and the provider are played by the ledger calls they make; tests/integration/
test_webhooks_pipeline.py sends signed events through the real API server, workers and sandbox.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox.actions.webhooks import WebhookOutcome
from outbox.errors import StaleFence
from outbox.evidence.handoffs import open_handoff
from outbox.evidence.settlement import settle_if_fenced
from outbox.evidence.sinks import EvidenceSink
from outbox.evidence.webhooks import EventReading, ReceivedEvent, receive
from outbox.ledger.claims import Claim, claim_due, claim_unknown
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import Attempt, Evidence, Handoff, Operation
from outbox.ledger.states import AttemptClass, EventKind, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.ledger.webhook_models import WebhookEvent
from outbox.reads.report import state_contradictions
from outbox.reads.webhook_events import documents_without_record
from producer import submit

ACTION = "payments.refund.create"
SINK = EvidenceSink(None)
SINCE = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)


def packet(session: Any, op: Operation, why: str) -> dict[str, Any]:
    return {"why": why, "operation_id": op.id}


def _submit(ledger: Any, key: str = "r-1", tenant: str = "acme") -> str:
    with ledger.sessions.begin() as s:
        return submit(
            s,
            tenant=tenant,
            idempotency_key=key,
            action=ACTION,
            args={"order_id": "o-1", "amount": Decimal("25.00"), "currency": "EUR"},
            subject="agent:bot",
        ).operation_id


def _claim(ledger: Any) -> Claim:
    with ledger.sessions.begin() as s:
        [c] = claim_due(s, worker="w1", lease_s=30)
    return c


def _finalize(ledger: Any, c: Claim, to: Status, report: AttemptReport) -> None:
    with ledger.sessions.begin() as s:
        finalize_if_fenced(s, c, report, to=to, reason=to.value)


def _unknown(ledger: Any, key: str = "r-1", tenant: str = "acme") -> str:
    op_id = _submit(ledger, key, tenant)
    _finalize(ledger, _claim(ledger), Status.OUTCOME_UNKNOWN, AttemptReport(AttemptClass.AMBIGUOUS, error="reset"))
    return op_id


def _accepted(ledger: Any, key: str = "r-1") -> str:
    op_id = _submit(ledger, key)
    report = AttemptReport(AttemptClass.ACCEPTED, status_code=202, provider_reference="re_1", response_digest="d0")
    _finalize(ledger, _claim(ledger), Status.ACCEPTED, report)
    return op_id


def _event(
    outcome: WebhookOutcome,
    *,
    event_id: str = "evt_1",
    key: str | None = "acme:r-1",
    reference: str | None = "re_1",
    scope: str | None = None,
    exclude: tuple[str, ...] = (),
) -> ReceivedEvent:
    return ReceivedEvent(
        target="payments",
        scope=scope,
        event_id=event_id,
        event_type=f"refund.{outcome.value}",
        scheme="standard",
        signed_at=dt.datetime.now(dt.UTC),
        body_digest="b" * 64,
        readings=[EventReading(ACTION, outcome, key, reference, {"id": reference, "status": outcome.value})],
        exclude_tenants=exclude,
    )


def _receive(ledger: Any, event: ReceivedEvent) -> Any:
    with ledger.sessions.begin() as s:
        return receive(s, event, actor="webhook:payments", sink=SINK, packet=packet)


def _op(ledger: Any, op_id: str) -> Operation:
    with ledger.sessions() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        return op


def _count(ledger: Any, model: Any, op_id: str) -> int:
    with ledger.sessions() as s:
        return int(s.execute(select(func.count()).select_from(model).where(model.operation_id == op_id)).scalar_one())


@pytest.mark.parametrize("state", ["outcome_unknown", "accepted"])
def test_a_success_event_settles_an_unknown_or_accepted_operation_once(ledger, state):
    op_id = _unknown(ledger) if state == "outcome_unknown" else _accepted(ledger)
    before = _op(ledger, op_id)
    got = _receive(ledger, _event(WebhookOutcome.SUCCEEDED))
    assert (got.disposition.value, got.operation_id, got.moved_to, got.duplicate) == (
        "settled",
        op_id,
        "succeeded",
        False,
    )
    op = _op(ledger, op_id)
    assert op.status == "succeeded" and op.result_reference == "re_1" and op.fencing_token == before.fencing_token + 1
    assert op.result == {"id": "re_1", "status": "succeeded"} and "evidence wins" in op.reason
    with ledger.sessions() as s:
        [row] = s.execute(select(Attempt).where(Attempt.worker == "webhook:payments")).scalars().all()
        assert (row.kind, row.attempt_class, row.provider_request_id, row.stale) == (
            "lookup",
            "succeeded",
            "evt_1",
            True,
        )
        assert row.applied_at is not None
        [ev] = s.execute(select(Evidence).where(Evidence.operation_id == op_id)).scalars().all()
        assert ev.provider_reference == "re_1"
        assert s.execute(select(WebhookEvent.disposition)).scalars().all() == ["settled"]
    # The provider's retry of the same event: answered, nothing changes.
    again = _receive(ledger, _event(WebhookOutcome.SUCCEEDED))
    assert again.duplicate and again.status == "succeeded" and again.operation_id == op_id
    assert _op(ledger, op_id).fencing_token == op.fencing_token and _count(ledger, Evidence, op_id) == 1
    assert _count(ledger, Attempt, op_id) == 2  # its dispatch attempt and the one event
    # Another event that confirms it once more: recorded, the operation already holds the effect.
    third = _receive(ledger, _event(WebhookOutcome.SUCCEEDED, event_id="evt_2"))
    assert third.disposition.value == "recorded" and _op(ledger, op_id).fencing_token == op.fencing_token
    with ledger.sessions() as s:
        assert state_contradictions(s, since=SINCE) == []


def test_a_success_event_takes_the_operation_from_its_worker_and_the_worker_is_fenced_off(ledger):
    op_id = _submit(ledger)
    c = _claim(ledger)  # dispatching: the request is out, its answer not back yet
    assert _receive(ledger, _event(WebhookOutcome.SUCCEEDED)).moved_to == "succeeded"
    with ledger.sessions.begin() as s, pytest.raises(StaleFence):
        finalize_if_fenced(
            s, c, AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_1"), to=Status.SUCCEEDED, reason="2xx"
        )
    assert _op(ledger, op_id).status == "succeeded"


def test_a_success_event_closes_the_handoff_of_an_operation_with_a_person(ledger):
    op_id = _unknown(ledger)
    with ledger.sessions.begin() as s:
        [r] = claim_unknown(s, worker="reconciler", lease_s=30)
        settle_if_fenced(s, r, AttemptReport(AttemptClass.AMBIGUOUS), to=Status.RECONCILIATION_REQUIRED, reason="down")
        open_handoff(s, op_id, reason="down", packet={})
    assert _receive(ledger, _event(WebhookOutcome.SUCCEEDED, reference="re_9")).moved_to == "succeeded"
    with ledger.sessions() as s:
        [h] = s.execute(select(Handoff).where(Handoff.operation_id == op_id)).scalars().all()
    assert h.status == "resolved" and h.resolution == "succeeded" and h.resolved_reference == "re_9"
    assert "webhook refund.succeeded (evt_1)" in (h.note or "")


def test_a_failure_event_makes_an_accepted_operation_due_for_a_lookup_and_moves_nothing_in_flight(ledger):
    # Events come in any order: a failure settles nothing by itself; the lookup reads the object now.
    op_id = _accepted(ledger)
    got = _receive(ledger, _event(WebhookOutcome.FAILED))
    assert (got.disposition.value, got.moved_to, got.status) == ("recorded", None, "accepted")
    assert "looking it up now" in got.note
    with ledger.sessions() as s:
        due, now = s.execute(select(Operation.next_attempt_at, db_now()).where(Operation.id == op_id)).one()
        assert as_utc(due) <= as_utc(now)
        assert s.execute(select(WebhookEvent.outcome)).scalar_one() == "failed"
    assert _count(ledger, Attempt, op_id) == 1  # no row of the event's: it answered nothing
    # A failure event for an operation a worker holds: its own answer decides, not the event.
    in_flight = _submit(ledger, "r-2")
    _claim(ledger)
    got = _receive(ledger, _event(WebhookOutcome.FAILED, event_id="evt_2", key="acme:r-2", reference=None))
    assert (got.disposition.value, got.operation_id, got.status) == ("recorded", in_flight, "dispatching")


def test_a_failure_event_does_not_undo_a_confirmed_success(ledger):
    op_id = _accepted(ledger)
    assert _receive(ledger, _event(WebhookOutcome.SUCCEEDED)).moved_to == "succeeded"
    got = _receive(ledger, _event(WebhookOutcome.FAILED, event_id="evt_2"))
    assert got.disposition.value == "recorded" and _op(ledger, op_id).status == "succeeded"


def test_a_pending_event_is_recorded_and_moves_nothing(ledger):
    op_id = _accepted(ledger)
    before = _op(ledger, op_id)
    got = _receive(ledger, _event(WebhookOutcome.PENDING))
    assert (got.disposition.value, got.status, got.moved_to) == ("recorded", "accepted", None)
    assert _op(ledger, op_id).fencing_token == before.fencing_token and _count(ledger, Attempt, op_id) == 1


def test_a_success_event_after_a_no_effect_end_goes_to_a_person(ledger):
    op_id = _submit(ledger)
    _finalize(
        ledger, _claim(ledger), Status.FAILED_BEFORE_COMMIT, AttemptReport(AttemptClass.REJECTED, status_code=422)
    )
    assert _receive(ledger, _event(WebhookOutcome.SUCCEEDED)).moved_to == "reconciliation_required"
    op = _op(ledger, op_id)
    assert op.status == "reconciliation_required" and "webhook refund.succeeded (evt_1)" in op.reason
    with ledger.sessions() as s:
        [h] = s.execute(select(Handoff).where(Handoff.operation_id == op_id)).scalars().all()
        assert h.status == "open"
        assert any(c["why"].startswith("flagged:") for c in state_contradictions(s, since=SINCE))


def test_an_event_for_no_operation_is_a_document_without_record(ledger):
    _unknown(ledger)
    got = _receive(ledger, _event(WebhookOutcome.SUCCEEDED, key="acme:nobody", reference="re_x"))
    assert (got.disposition.value, got.operation_id) == ("no_operation", None)
    with ledger.sessions() as s:
        [doc] = documents_without_record(s, since=SINCE)
    assert doc["source"] == "webhook" and doc["event_id"] == "evt_1" and doc["reference"] == "re_x"
    assert doc["idempotency_key"] == "acme:nobody" and doc["actions"] == [ACTION] and doc["ledger"] == []


def test_a_tenants_endpoint_settles_its_own_operations_only(ledger):
    theirs = _unknown(ledger, "r-1", tenant="globex")
    # acme's endpoint (its secret) names globex's key: not acme's operation, so nothing moves.
    got = _receive(ledger, _event(WebhookOutcome.SUCCEEDED, key="globex:r-1", reference=None, scope="acme"))
    assert got.disposition.value == "no_operation" and _op(ledger, theirs).status == "outcome_unknown"
    # The target's own endpoint never settles a tenant that receives at its own.
    shared = _event(WebhookOutcome.SUCCEEDED, event_id="evt_2", key="globex:r-1", reference=None, exclude=("globex",))
    assert _receive(ledger, shared).disposition.value == "no_operation"
    assert _op(ledger, theirs).status == "outcome_unknown"
    # globex's own endpoint does.
    own = _event(WebhookOutcome.SUCCEEDED, event_id="evt_3", key="globex:r-1", reference=None, scope="globex")
    assert _receive(ledger, own).moved_to == "succeeded"
    with ledger.sessions() as s:
        history = s.execute(select(Operation.reason).where(Operation.id == theirs)).scalar_one()
    assert "evt_3" in history


def test_the_history_says_a_webhook_settled_it(ledger):
    from outbox.ledger.history import HistoryEvent

    op_id = _unknown(ledger)
    _receive(ledger, _event(WebhookOutcome.SUCCEEDED))
    with ledger.sessions() as s:
        last = (
            s.execute(select(HistoryEvent).where(HistoryEvent.operation_id == op_id).order_by(HistoryEvent.id.desc()))
            .scalars()
            .first()
        )
    assert last is not None and last.event == EventKind.WEBHOOK.value and last.actor == "webhook:payments"
    assert (last.from_status, last.to_status) == ("outcome_unknown", "succeeded")


def test_a_reconciler_claim_between_the_events_read_and_its_lock_is_fenced_off(pg_ledger):
    """The event reads its operation, a reconciler claims it (token + 1) before the event locks the
    row: the event's move is guarded by the token it holds once locked, and the reconciler's
    settlement is the one refused."""
    op_id = _unknown(pg_ledger)
    claims: list[Claim] = []

    def reconciler_claims_meanwhile(op: Operation, reading: EventReading) -> None:
        with pg_ledger.sessions.begin() as other:
            claims.extend(claim_unknown(other, worker="reconciler", lease_s=30, operation_id=op_id))

    with pg_ledger.sessions.begin() as s:
        got = receive(
            s,
            _event(WebhookOutcome.SUCCEEDED),
            actor="webhook:payments",
            sink=SINK,
            packet=packet,
            owns=reconciler_claims_meanwhile,
        )
    assert got.moved_to == "succeeded" and len(claims) == 1
    with pg_ledger.sessions.begin() as s, pytest.raises(StaleFence):
        settle_if_fenced(s, claims[0], AttemptReport(AttemptClass.AMBIGUOUS), to=Status.OUTCOME_UNKNOWN, reason="down")
    op = _op(pg_ledger, op_id)
    assert op.status == "succeeded" and op.fencing_token == claims[0].fencing_token + 1


def test_with_match_an_event_whose_object_is_not_the_intents_settles_nothing(ledger):
    """``webhooks.match`` (as lookup.match): the operation the event names is its own only if the object's
    fields equal the intent's arguments; one it names and does not match is not settled."""
    from workers.provider.actions import parse_actions
    from workers.webhooks.events import owner_check

    actions = parse_actions(
        {
            "targets": {
                "payments": {"base_url": "http://127.0.0.1:1", "webhooks": {"scheme": "stripe", "secret": "s"}}
            },
            "actions": {
                ACTION: {
                    "target": "payments",
                    "request": {"method": "POST", "path": "/v1/refunds"},
                    "args": ["order_id", "amount", "currency"],
                    "webhooks": {
                        "key": "idempotency_key",
                        "succeeded": ["refund.succeeded"],
                        "match": {"amount": "{amount}", "currency": {"equals": "{currency}", "compare": "casefold"}},
                    },
                }
            },
        }
    )
    op_id = _unknown(ledger)

    def event(event_id: str, amount: str) -> ReceivedEvent:
        obj = {"id": "re_1", "amount": amount, "currency": "eur", "idempotency_key": "acme:r-1"}
        reading = EventReading(ACTION, WebhookOutcome.SUCCEEDED, "acme:r-1", "re_1", obj)
        return ReceivedEvent("payments", None, event_id, "refund.succeeded", "stripe", None, "b" * 64, [reading])

    with ledger.sessions.begin() as s:
        wrong = receive(s, event("evt_1", "99.00"), actor="w", sink=SINK, packet=packet, owns=owner_check(actions))
    assert wrong.disposition.value == "no_operation" and "amount differs" in wrong.note
    assert _op(ledger, op_id).status == "outcome_unknown"
    with ledger.sessions.begin() as s:
        right = receive(s, event("evt_2", "25.0"), actor="w", sink=SINK, packet=packet, owns=owner_check(actions))
    assert right.moved_to == "succeeded"  # 25.0 == 25.00 as decimals; EUR == eur casefolded
