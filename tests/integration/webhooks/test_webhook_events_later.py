"""Webhook events kept before their operation could take them, on SQLite and PostgreSQL (review of issue
50, findings 4, 5, 10): kept once per (target, whose secret verified it, event id), whatever path; found
again when the operation enters accepted / outcome_unknown (outbox/evidence/stored_events.py); the
report lists one whose operation exists and was never brought in line with it.

tests/integration/webhooks/test_webhooks_later.py sends the same through the real API server, workers and sandbox.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import func, select

from outbox.actions.webhooks import WebhookOutcome
from outbox.evidence.stored_events import due_now, mark_applied, successes_for
from outbox.ledger.models import Operation
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport
from outbox.ledger.webhook_models import WebhookEvent
from outbox.reads.webhook_events import documents_without_record
from tests.integration.webhooks.test_webhook_ledger import SINCE, _claim, _event, _finalize, _op, _receive, _submit


def _rows(ledger: Any) -> int:
    with ledger.sessions() as s:
        return int(s.execute(select(func.count()).select_from(WebhookEvent)).scalar_one())


def test_an_event_posted_again_under_another_path_its_secret_verifies_is_not_kept_again(ledger):
    op_id = _submit(ledger)
    first = _receive(ledger, _event(WebhookOutcome.PENDING, reference=None))
    assert (first.duplicate, first.operation_id) == (False, op_id)
    # The same signed request at /v1/webhooks/payments/beta (beta shares the target's secret).
    again = _receive(ledger, dataclasses.replace(_event(WebhookOutcome.PENDING, reference=None), scope="beta"))
    assert again.duplicate and _rows(ledger) == 1
    # A tenant's own secret is another owner: its event is its own.
    own = dataclasses.replace(_event(WebhookOutcome.PENDING, reference=None), scope="acme", verified_by="acme")
    assert not _receive(ledger, own).duplicate and _rows(ledger) == 2


def test_a_failure_kept_while_in_flight_makes_the_operation_due_once_it_is_accepted(ledger):
    op_id = _submit(ledger)
    c = _claim(ledger)  # dispatching
    got = _receive(ledger, _event(WebhookOutcome.FAILED, reference=None))
    assert (got.disposition.value, got.status) == ("recorded", "dispatching")
    report = AttemptReport(AttemptClass.ACCEPTED, status_code=202, provider_reference="re_1")
    _finalize(ledger, c, Status.ACCEPTED, report)
    other = _submit(ledger, "r-2")
    _finalize(ledger, _claim(ledger), Status.OUTCOME_UNKNOWN, AttemptReport(AttemptClass.AMBIGUOUS, error="reset"))
    with ledger.sessions.begin() as s:
        assert due_now(s, [op_id, other]) == [op_id]
    assert _op(ledger, op_id).status == "accepted"  # due, not settled: the lookup reads the object


def test_a_success_named_by_a_reference_not_recorded_yet_is_found_and_reported_until_applied(ledger):
    op_id = _submit(ledger)
    c = _claim(ledger)
    # The provider's event names only its reference; the 202's finalize has not recorded it yet.
    early = _receive(ledger, _event(WebhookOutcome.SUCCEEDED, key=None, reference="re_7"))
    assert (early.disposition.value, early.operation_id) == ("no_operation", None)
    report = AttemptReport(AttemptClass.ACCEPTED, status_code=202, provider_reference="re_7")
    _finalize(ledger, c, Status.ACCEPTED, report)
    with ledger.sessions.begin() as s:
        assert due_now(s, [op_id]) == [op_id]
        [stored] = successes_for(s, [op_id])
    assert (stored.operation_id, stored.reference, stored.scope) == (op_id, "re_7", "")
    # Its operation exists now and was never brought in line with it: listed, with that operation.
    with ledger.sessions() as s:
        [doc] = documents_without_record(s, since=SINCE)
    assert doc["event_id"] == "evt_1" and doc["ledger"][0]["operation_id"] == op_id
    assert "never brought in line" in doc["why"]
    with ledger.sessions.begin() as s:
        mark_applied(s, [stored.row_id], operation_id=op_id, tenant="acme", moved_to=Status.SUCCEEDED)
        assert successes_for(s, [op_id]) == []
        row = s.execute(select(WebhookEvent)).scalar_one()
        assert (row.disposition, row.operation_id, row.outcome) == ("settled", op_id, "succeeded")
    with ledger.sessions() as s:
        assert documents_without_record(s, since=SINCE) == []


def test_an_event_for_another_tenants_endpoint_is_not_found_for_an_operation(ledger):
    op_id = _submit(ledger, tenant="acme")
    c = _claim(ledger)
    _receive(ledger, _event(WebhookOutcome.SUCCEEDED, key=None, reference="re_8", scope="globex"))
    _finalize(ledger, c, Status.ACCEPTED, AttemptReport(AttemptClass.ACCEPTED, provider_reference="re_8"))
    with ledger.sessions.begin() as s:
        assert successes_for(s, [op_id]) == [] and due_now(s, [op_id]) == []
        assert s.execute(select(Operation.status).where(Operation.id == op_id)).scalar_one() == "accepted"
