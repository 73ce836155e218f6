"""Each call as a Celery task: the events call_events.py sends, fed to Celery's own event state (the
state machine Flower subclasses), give one task per operation in the ledger's state; its uuid and
name follow from the operation; nothing of the intent's arguments travels; nothing is sent while
the worker sends no task events."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery.events.state import State

from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass, AttemptKind, Status, WaitingFor
from workers.engine import call_events
from workers.engine.outcomes import (
    Accepted,
    Ambiguous,
    Cancelled,
    NeedsApproval,
    Rejected,
    RetryAt,
    Succeeded,
)
from workers.ground import event_sender
from workers.provider.lookups import LookupResult
from workers.reconcile.judge import LookupVerdict

OP = str(uuid.uuid4())
CANARY = "canary-9b2e44"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def claim(n: int = 1, *, kind: AttemptKind = AttemptKind.DISPATCH, status: Status = Status.DISPATCHING) -> Claim:
    return Claim(
        operation_id=OP,
        fencing_token=n,
        attempt_id=n,
        attempt_number=n,
        kind=kind,
        tenant="acme",
        idempotency_key="wf-1:refund",
        action="payments.refund.create",
        args=json.dumps({"order_id": CANARY, "amount": "12.50"}),
        args_digest="d",
        subject="s",
        worker="w",
        lease_expires_at=T0 + timedelta(seconds=60),
        max_attempts=None,
        attempt_count=1 if kind is AttemptKind.LOOKUP else n,
        deadline_at=None,
        created_at=T0,
        cancel_requested=False,
        open_ambiguity=False,
        status=status,
    )


@dataclass(frozen=True)
class Looked:
    claim: Claim
    found: LookupResult | None
    verdict: LookupVerdict


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The events sent, each as an event consumer receives it (Celery's envelope added)."""
    out: list[dict[str, Any]] = []
    clock = iter(range(1, 10_000))

    def send(type_: str, fields: dict[str, Any]) -> None:
        out.append({"type": type_, "hostname": "w1@host", "clock": next(clock), "local_received": 0.0, **fields})

    monkeypatch.setattr(event_sender, "on", lambda: True)
    monkeypatch.setattr(event_sender, "send", send)
    return out


def flower_state(events: list[dict[str, Any]]) -> State:
    state = State()
    for event in events:
        state.event(dict(event))
    return state


def dispatch(c: Claim, outcome: Any, to: Status, reason: str = "", **fields: Any) -> None:
    call_events.dispatched([(c, outcome, to, reason, {"class": "x", "latency_s": 0.012, **fields})])


def test_uuid_and_name_follow_from_the_operation():
    assert call_events.call_uuid(OP) == OP  # the operation id: pasted from the console into Flower
    assert call_events.lookup_uuid(OP, 1) == call_events.lookup_uuid(OP, 1) != call_events.lookup_uuid(OP, 2)
    assert call_events.call_name("payments.refund.create") == "outbox.payments.refund.create"
    assert call_events.lookup_name("payments.refund.create") == "outbox.lookup.payments.refund.create"


def test_a_retried_call_is_one_task_with_its_retries_then_success(sent):
    first, second = claim(1), claim(2)
    call_events.claimed([first])
    call_events.sending(first)
    dispatch(first, RetryAt(2.0, "http_429", waiting_for=WaitingFor.RETRY_AFTER), Status.NOT_DISPATCHED, "http_429")
    call_events.claimed([second])
    call_events.sending(second)
    dispatch(second, Succeeded("re_1", {"id": "re_1"}), Status.SUCCEEDED)

    task = flower_state(sent).tasks[OP]
    assert (task.name, task.state, task.retries) == ("outbox.payments.refund.create", "SUCCESS", 1)
    assert task.args == repr((OP, "acme")) and task.kwargs == "{}"
    assert "re_1" in task.result and task.runtime == 0.012
    assert task.retried and "http_429" in task.exception and "2.000s" in task.exception
    assert [e["type"] for e in sent].count("task-succeeded") == 1


@pytest.mark.parametrize(
    ("outcome", "to", "state"),
    [
        (Rejected("http_422"), Status.FAILED_BEFORE_COMMIT, "FAILURE"),
        (Ambiguous("timeout"), Status.OUTCOME_UNKNOWN, "OUTCOME_UNKNOWN"),
        (Accepted("re_2", None, "http_202_accepted", 1.0), Status.ACCEPTED, "ACCEPTED"),
        (Cancelled("cancel requested"), Status.CANCELLED, "REVOKED"),
        (NeedsApproval("approval expired"), Status.AWAITING_APPROVAL, "RETRY"),
    ],
)
def test_each_outcome_shows_the_ledgers_state(sent, outcome, to, state):
    c = claim()
    call_events.claimed([c])
    call_events.sending(c)
    dispatch(c, outcome, to, getattr(outcome, "why", ""))
    assert flower_state(sent).tasks[OP].state == state
    if to is not Status.FAILED_BEFORE_COMMIT:
        assert "task-failed" not in [e["type"] for e in sent]  # only a final failure is FAILURE


def test_an_unknown_outcome_settled_by_a_lookup(sent):
    c = claim()
    call_events.claimed([c])
    call_events.sending(c)
    dispatch(c, Ambiguous("connection reset"), Status.OUTCOME_UNKNOWN, "connection reset")
    look = claim(1, kind=AttemptKind.LOOKUP, status=Status.OUTCOME_UNKNOWN)
    found = LookupResult("found", "found", provider_reference="re_9", status_code=200, latency_s=0.02)
    call_events.lookups_claimed([look])
    call_events.looking_up(look)
    call_events.settled(
        Looked(look, None, LookupVerdict(Status.OUTCOME_UNKNOWN, AttemptClass.NOT_SENT, "breaker", 3.0)),
        Status.OUTCOME_UNKNOWN,
    )
    lookup_task = flower_state(sent).tasks[call_events.lookup_uuid(OP, 1)]
    assert lookup_task.state == "RETRY" and "3.000s" in lookup_task.exception  # it looks again later
    call_events.lookups_claimed([look])
    call_events.looking_up(look)
    call_events.settled(Looked(look, found, LookupVerdict(Status.SUCCEEDED, AttemptClass.SUCCEEDED, "found", reference="re_9")), Status.SUCCEEDED)  # fmt: skip

    state = flower_state(sent)
    op, lookup = state.tasks[OP], state.tasks[call_events.lookup_uuid(OP, 1)]
    assert (op.state, lookup.state) == ("SUCCESS", "SETTLED") and "re_9" in op.result
    assert lookup.name == "outbox.lookup.payments.refund.create" and lookup.runtime == 0.02
    # One success for the operation: the lookup's end is not a second one (Flower's counts).
    assert [e["type"] for e in sent].count("task-succeeded") == 1
    assert "task-failed" not in [e["type"] for e in sent]


def test_a_handoff_and_a_redispatch_after_a_lookup(sent):
    look = claim(1, kind=AttemptKind.LOOKUP, status=Status.OUTCOME_UNKNOWN)
    absent = LookupVerdict(Status.NOT_DISPATCHED, AttemptClass.NOT_SENT, "not found: never executed")
    call_events.settled(Looked(look, None, absent), Status.NOT_DISPATCHED)
    assert flower_state(sent).tasks[OP].state == "RETRY"
    person = LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, "no lookup declared")
    call_events.settled(Looked(look, None, person), Status.RECONCILIATION_REQUIRED)
    state = flower_state(sent)
    assert state.tasks[OP].state == state.tasks[call_events.lookup_uuid(OP, 1)].state == "RECONCILIATION_REQUIRED"


def test_no_argument_of_the_intent_in_any_event(sent):
    c = claim()
    call_events.claimed([c])
    call_events.sending(c)
    dispatch(c, Rejected(f"local_validation: order_id {CANARY!r} is not known"), Status.FAILED_BEFORE_COMMIT,
             f"local_validation: order_id {CANARY!r} is not known")  # fmt: skip
    shown = json.dumps(sent)
    assert CANARY not in shown and "wf-1:refund" not in shown and "local_validation" in shown


def test_nothing_is_sent_while_the_worker_sends_no_task_events(monkeypatch):
    monkeypatch.setattr(event_sender, "_switch", None)  # outside a worker
    calls: list[Any] = []
    monkeypatch.setattr(event_sender, "send", lambda *a: calls.append(a))
    c = claim()
    call_events.claimed([c])
    call_events.sending(c)
    dispatch(c, Succeeded("re_1", None), Status.SUCCEEDED)
    call_events.late_successes({OP: Status.SUCCEEDED})
    assert calls == []


@pytest.mark.parametrize(
    ("enabled", "groups", "on"),
    [
        (True, set(), True),  # -E / worker_send_task_events: every group
        (True, {"worker"}, False),  # no task events
        (True, {"worker", "task"}, True),  # Flower's enable_events
        (False, set(), False),  # no events at all
    ],
)
def test_the_pool_follows_the_workers_dispatcher(monkeypatch, enabled, groups, on):
    monkeypatch.setattr(event_sender, "_switch", None)
    event_sender.install(app=None, hostname="w1@host", task_events=not on)
    dispatcher = type("D", (), {"enabled": enabled, "groups": groups})()
    event_sender.TaskEventsSwitch.sync(type("Consumer", (), {"event_dispatcher": dispatcher})())
    assert event_sender.on() is on
