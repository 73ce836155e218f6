"""Conformance: the new operation row (insert_operation, notify_due) and the plain reads of it
(current_row, read_due). See conftest.py for how to run this against a new driver.

The writes a producer makes in its own transaction (insert_operation, notify_due, and submit /
submit_run above them) take ``access``: they run on every access path, an application's driver
(psycopg 3, psycopg2, asyncpg, psycopg's async connection, aiosqlite), not only the ledger's."""

from __future__ import annotations

from decimal import Decimal

import pytest
from sqlalchemy import select

from outbox.errors import IdempotencyConflict
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.drivers.base import Inserted
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import EventKind, Status, WaitingFor
from outbox.runs.lifecycle import submit_run
from producer import submit

OP = core_table(Operation)


def test_driver_for_an_engine_a_session_and_a_connection_is_the_one_driver_of_its_database(case):
    assert case.driver.name == case.expect.name
    with case.sessions() as s, case.engine.connect() as conn:
        assert driver_for(s) is driver_for(conn) is case.driver


def test_insert_operation_writes_the_row_as_given_with_times_from_the_database_clock(access):
    case = access
    new = case.new_operation(
        run_id="run-1", tool_call_id="call-1", max_attempts=3, deadline_s=600.0, delay_s=5.0, submitted_by="key:1"
    )
    before = case.db_time()
    inserted = case.within(lambda s: case.driver.insert_operation(s, new))
    row = case.op(new.id)
    assert inserted == Inserted(row.created_at, row.updated_at, row.next_attempt_at, row.deadline_at), (
        "the row's times as the database stored them"
    )
    for name in ("id", "tenant", "idempotency_key", "provider_key", "action", "args", "args_digest", "subject"):
        assert getattr(row, name) == getattr(new, name), name
    assert (row.run_id, row.tool_call_id, row.submitted_by, row.key_space) == ("run-1", "call-1", "key:1", "intent")
    assert (row.status, row.waiting_for, row.reason) == ("not_dispatched", None, "submitted")
    assert (row.fencing_token, row.attempt_count, row.max_attempts) == (0, 0, 3)
    assert (row.cancel_requested, row.proven_absent_through) == (False, 0)
    assert row.lease_owner is None and row.lease_expires_at is None and row.published_at is None
    assert row.finished_at is None and row.result is None and row.error_class is None
    assert 0 <= case.seconds(row.created_at, before) < 5
    assert case.seconds(row.updated_at, row.created_at) >= 0
    assert abs(case.seconds(row.next_attempt_at, row.created_at) - 5.0) < 0.5, "due delay_s after now"
    assert abs(case.seconds(row.deadline_at, row.created_at) - 600.0) < 0.5, "deadline deadline_s after now"


def test_insert_operation_without_a_deadline_leaves_deadline_at_null_and_keeps_the_key_space(access):
    case = access
    op_id = case.submit(key_space="run", status=Status.AWAITING_APPROVAL, waiting_for=WaitingFor.APPROVAL)
    row = case.op(op_id)
    assert row.deadline_at is None and row.max_attempts is None
    assert (row.key_space, row.status, row.waiting_for) == ("run", "awaiting_approval", "approval")


def test_insert_operation_writes_one_submit_event_from_no_status(access):
    case = access
    op_id = case.submit(reason="subject agent, run r")
    (event,) = case.events(op_id)
    assert event.at == case.op(op_id).created_at, "dated when the row was created"
    assert (event.from_status, event.to_status, event.event) == (None, "not_dispatched", EventKind.SUBMIT.value)
    assert (event.fencing_token, event.reason, event.actor) == (0, "subject agent, run r", "agent")


def test_insert_operation_returns_none_and_changes_nothing_when_the_tenant_already_has_the_key(access):
    case = access
    first = case.new_operation()
    again = case.new_operation(idempotency_key=first.idempotency_key, args='{"other":1}', args_digest="e" * 64)
    assert case.within(lambda s: case.driver.insert_operation(s, first)) is not None
    assert case.within(lambda s: case.driver.insert_operation(s, again)) is None
    row = case.op(first.id)
    assert (row.args, row.args_digest) == (first.args, first.args_digest)
    assert case.events(again.id) == [] and len(case.events(first.id)) == 1, "a replay writes no event"


def test_insert_operation_takes_the_same_key_in_another_tenant(access):
    case = access
    first = case.submit(tenant="a", idempotency_key="same")
    second = case.submit(tenant="b", idempotency_key="same")
    assert first != second and case.op(second).tenant == "b"


def test_insert_operation_rolls_back_with_the_callers_transaction(access):
    case = access
    new = case.new_operation()
    assert case.within(lambda s: case.driver.insert_operation(s, new), commit=False) is not None
    assert case.within(lambda s: case.driver.current_row(s, new.id)) is None
    assert case.within(lambda s: case.driver.insert_operation(s, new)) is not None, "nothing of the rolled back remains"
    assert case.within(lambda s: tuple(case.driver.current_row(s, new.id))) == ("not_dispatched", 0)


def test_insert_operation_notifies_the_listener_on_commit_only_for_a_due_status_where_the_database_notifies(access):
    case = access
    listener = case.driver.listener(case.engine)
    if not case.expect.notifies:
        assert listener is None, "no NOTIFY: the relay polls (mark_due)"
        return
    with listener.connected():
        waiting = case.new_operation(status=Status.AWAITING_APPROVAL, waiting_for=WaitingFor.APPROVAL)
        due, gone = case.new_operation(), case.new_operation()
        case.within(lambda s: case.driver.insert_operation(s, waiting))
        case.within(lambda s: case.driver.insert_operation(s, gone), commit=False)

        def insert_due(s):
            case.driver.insert_operation(s, due)
            assert case.heard(listener, {due.id}, timeout_s=0.3) == [], "nothing is told before the commit"

        case.within(insert_due)
        assert case.heard(listener, {due.id}) == [due.id], (
            "the due row, once; never one awaiting approval or rolled back"
        )
        again = case.new_operation(idempotency_key=due.idempotency_key)
        assert case.within(lambda s: case.driver.insert_operation(s, again)) is None
        assert case.heard(listener, {"none"}, timeout_s=0.3) == [], "a replay inserts nothing and tells nothing"


def test_notify_due_tells_the_listener_on_commit_and_not_on_rollback_where_the_database_notifies(access):
    case = access
    op_id = case.submit(status=Status.AWAITING_APPROVAL, waiting_for=WaitingFor.APPROVAL)
    listener = case.driver.listener(case.engine)
    if not case.expect.notifies:
        assert listener is None
        case.within(lambda s: case.driver.notify_due(s, op_id))  # accepted, does nothing: the relay polls
        return
    with listener.connected():
        case.within(lambda s: case.driver.notify_due(s, op_id), commit=False)
        assert case.heard(listener, {op_id}, timeout_s=0.3) == []
        case.within(lambda s: case.driver.notify_due(s, op_id))
        assert case.heard(listener, {op_id}) == [op_id]


# -- the producer's calls above the driver, on each access path ------------------------------------
REFUND = {"order_id": "o-9", "amount": Decimal("25.00"), "currency": "EUR"}


def test_submit_on_each_access_path_is_one_operation_per_key_and_refuses_changed_arguments(access):
    case = access

    def intent(s, **kw):
        fields = dict(tenant="acme", idempotency_key="wf-1:refund", action="payments.refund.create", subject="agent")
        return submit(s, **(fields | {"args": REFUND, "max_attempts": 3, "deadline_s": 600, "delay_s": 0} | kw))

    first = case.within(intent)
    again = case.within(lambda s: intent(s, args={**REFUND, "amount": Decimal("25.0")}))  # the same number
    assert (first.new, again.new, again.operation_id) == (True, False, first.operation_id)
    assert (again.status, again.args_digest, again.provider_key) == (
        "not_dispatched",
        first.args_digest,
        "acme:wf-1:refund",
    )
    with pytest.raises(IdempotencyConflict):
        case.within(lambda s: intent(s, args={**REFUND, "amount": Decimal("26.00")}))
    held = case.within(lambda s: intent(s, idempotency_key="wf-2:refund", requires_approval=True, deadline_s=None))
    assert (held.status, case.op(held.operation_id).waiting_for) == ("awaiting_approval", "approval")
    gone = case.within(lambda s: intent(s, idempotency_key="wf-3:refund"), commit=False)
    assert case.within(lambda s: case.driver.current_row(s, gone.operation_id)) is None
    row = case.op(first.operation_id)
    assert (row.max_attempts, round(case.seconds(row.deadline_at, row.created_at))) == (3, 600)


def test_submit_run_on_each_access_path_writes_the_run_and_its_first_step(access):
    case = access
    steps = [
        {"name": "order", "action": "shop.order.create", "args": {"ref": "PO-1", "qty": 2}},
        {"name": "notify", "action": "notify.email.send", "args": {"to": "buyer"}},
    ]

    def run(s, **kw):
        return submit_run(s, tenant="acme", run_key="po-1", subject="agent:buyer", steps=steps, **kw)

    first = case.within(lambda s: run(s, budget={"max_attempts": 4, "deadline_s": 300.5}))
    again = case.within(lambda s: run(s, budget={"max_attempts": 4, "deadline_s": 300.5}))
    assert (first.new, again.new, again.run_id, first.status) == (True, False, first.run_id, "running")
    with case.sessions() as s:
        (step,) = s.execute(select(OP).where(OP.c.run_id == first.run_id)).all()
    assert (step.idempotency_key, step.key_space, step.status, step.max_attempts) == (
        "po-1:order",
        "run",
        "not_dispatched",
        4,
    )


def test_current_row_is_the_status_and_fencing_token_or_none_for_an_unknown_id(case):
    op_id = case.submit()
    claimed = case.claim_one(op_id)
    with case.sessions() as s:
        row = case.driver.current_row(s, op_id)
        assert (row.status, row.fencing_token) == ("dispatching", claimed.fencing_token)
        assert case.driver.current_row(s, "no-such-operation") is None


def test_read_due_returns_only_the_given_ids_that_are_not_dispatched_and_due_now(case):
    due, later, claimed, waiting, other = (case.submit() for _ in range(5))
    case.set(later, next_attempt_at=db_now(60))
    case.claim_one(claimed)
    case.set(waiting, status=Status.AWAITING_APPROVAL.value)
    with case.sessions() as s:
        rows = case.driver.read_due(s, [due, later, claimed, waiting, "no-such-operation"])
        assert case.driver.read_due(s, []) == []
    assert [r.id for r in rows] == [due], f"{other} was not asked about"


def test_read_due_carries_what_a_deadline_check_needs_and_the_database_time(case):
    op_id = case.submit(max_attempts=4, deadline_s=120.0)
    before = case.db_time()
    with case.sessions() as s:
        (row,) = case.driver.read_due(s, [op_id])
    stored = case.op(op_id)
    assert (row.id, row.action, row.max_attempts, row.attempt_count) == (op_id, stored.action, 4, 0)
    assert case.seconds(row.created_at, stored.created_at) == 0
    assert case.seconds(row.deadline_at, stored.deadline_at) == 0
    assert 0 <= case.seconds(row.db_now, before) < 5, "db_now is the database's clock"
    assert case.op(op_id) == stored, "a read changes nothing"
