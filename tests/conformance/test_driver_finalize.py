"""Conformance: finalize (a worker's fenced end of its attempt, a reconciler's settlement of its
lookup) and mark_attempt_stale. See conftest.py for how to run this against a new driver."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import AttemptClass, AttemptKind, EventKind, Status
from outbox.ledger.writes import CANCEL_NOTE

OP = core_table(Operation)
C = AttemptClass
RESULT = {"id": "re_1", "amount": "10.00", "nested": {"ok": True}}

# Each move out of dispatching: the class that makes it, then what the row holds afterwards.
# success: the provider's reference, digest and result are kept (error_class cleared); else the
# attempt's class and error. rescheduled: due again delay_s after the move. terminal: finished_at.
TARGETS = [
    # (to, klass, success, rescheduled, terminal)
    (Status.SUCCEEDED, C.SUCCEEDED, True, False, True),
    (Status.COMMITTED_EVIDENCE_DEGRADED, C.SUCCEEDED, True, False, False),
    (Status.ACCEPTED, C.ACCEPTED, True, True, False),
    (Status.OUTCOME_UNKNOWN, C.AMBIGUOUS, False, True, False),
    (Status.NOT_DISPATCHED, C.NOT_PROCESSED, False, True, False),
    (Status.AWAITING_APPROVAL, C.NOT_SENT, False, False, False),
    (Status.FAILED_BEFORE_COMMIT, C.REJECTED, False, False, True),
    (Status.FAILED_AT_PROVIDER, C.REJECTED, False, False, True),
    (Status.CANCELLED, C.NOT_SENT, False, False, True),
]


def claimed(case: Any, **submit: Any) -> Any:
    return case.claim_one(case.submit(**submit))


@pytest.mark.parametrize(
    ("to", "klass", "success", "rescheduled", "terminal"), TARGETS, ids=[t[0].value for t in TARGETS]
)
def test_finalize_moves_a_dispatching_row_to_each_target_and_writes_what_that_move_writes(
    case, to, klass, success, rescheduled, terminal
):
    row = claimed(case)
    write = case.write(row, to, klass, delay_s=30.0, result=RESULT if success else None, reference="re_1")
    assert case.finalize(write) == [(True, True)], "a no-effect move passes its guard: its own attempt never counts"
    op = case.op(row.id)
    now = case.db_time()
    assert (op.status, op.fencing_token, op.attempt_count) == (to.value, row.fencing_token, 1)
    assert (op.reason, op.waiting_for) == ("because", write.params["waiting_for"])
    assert op.lease_owner is None and op.lease_expires_at is None, "the lease is released"
    assert -5 < case.seconds(op.updated_at, now) <= 0
    if success:
        assert (op.result_reference, op.result_digest, op.result, op.error_class) == ("re_1", "r" * 64, RESULT, None)
    else:
        assert (op.error_class, op.last_error) == (klass.value, f"{klass.value} error")
        assert op.result_reference is None and op.result is None
    if rescheduled:
        assert abs(case.seconds(op.next_attempt_at, op.updated_at) - 30.0) < 0.5
    else:
        assert case.seconds(op.next_attempt_at, op.updated_at) < 0, "the due time stays as it was"
    assert (op.finished_at is not None) is terminal

    attempt = case.attempt(row.attempt_id)
    assert (attempt.attempt_class, attempt.status_code, attempt.provider_reference) == (klass.value, 200, "re_1")
    assert (attempt.request_digest, attempt.provider_request_id, attempt.response_digest) == (
        "q" * 64,
        "req-1",
        "r" * 64,
    )
    assert (attempt.retry_after_s, attempt.latency_s, attempt.error) == (2.5, 0.125, f"{klass.value} error")
    assert attempt.stale is False and attempt.ended_at is not None

    event = case.events(row.id)[-1]
    assert (event.from_status, event.to_status, event.event) == (
        "dispatching",
        to.value,
        EventKind.ATTEMPT_RESULT.value,
    )
    assert (event.fencing_token, event.reason, event.actor) == (row.fencing_token, write.params["event_reason"], "w1")


def test_finalize_notes_a_cancel_asked_for_in_flight_on_a_success_and_not_on_a_retry(case):
    done, retried = claimed(case), claimed(case)
    case.set(done.id, cancel_requested=True)
    case.set(retried.id, cancel_requested=True)
    case.finalize(
        case.write(done, Status.SUCCEEDED, C.SUCCEEDED, reference="re_1"),
        case.write(retried, Status.NOT_DISPATCHED, C.NOT_PROCESSED),
    )
    assert case.op(done.id).reason == "because" + CANCEL_NOTE
    assert case.op(retried.id).reason == "because"


def test_finalize_with_refund_gives_the_attempt_back_to_the_budget(case):
    refunded, counted = claimed(case), claimed(case)
    case.finalize(
        case.write(refunded, Status.NOT_DISPATCHED, C.NOT_SENT, refund=True),
        case.write(counted, Status.NOT_DISPATCHED, C.NOT_SENT, refund=False),
    )
    assert (case.op(refunded.id).attempt_count, case.op(counted.id).attempt_count) == (0, 1)
    assert case.attempt(refunded.attempt_id).attempt_class == "not_sent", "the attempt row stays as evidence"


def test_finalize_writes_json_results_and_no_result_as_null(case):
    with_result, without = claimed(case), claimed(case)
    case.finalize(
        case.write(with_result, Status.SUCCEEDED, C.SUCCEEDED, result=RESULT, reference="re_1"),
        case.write(without, Status.SUCCEEDED, C.SUCCEEDED, result=None, reference="re_2"),
    )
    assert case.op(with_result.id).result == RESULT
    with case.sessions() as s:
        assert s.execute(select(OP.c.result.is_(None)).where(OP.c.id == without.id)).scalar_one(), "SQL NULL"


@pytest.mark.parametrize(
    ("earlier", "kind", "stale"),
    [
        (C.AMBIGUOUS, AttemptKind.DISPATCH, False),
        (C.PENDING, AttemptKind.DISPATCH, False),  # a worker that never reported back
        (C.SUCCEEDED, AttemptKind.DISPATCH, True),  # a zombie's late confirmation: evidence all the same
        (C.SUCCEEDED, AttemptKind.LOOKUP, False),  # a confirmation of any kind
    ],
)
@pytest.mark.parametrize("to", [Status.FAILED_BEFORE_COMMIT, Status.CANCELLED, Status.FAILED_AT_PROVIDER])
def test_finalize_guard_refuses_no_effect_while_another_attempt_may_have_taken_effect(case, earlier, kind, stale, to):
    op_id = case.submit()
    case.add_attempt(op_id, 1, earlier, kind, stale=stale)
    row = case.claim_one(op_id)
    before = case.op(op_id)
    assert case.finalize(case.write(row, to, C.REJECTED)) == [(True, False)]
    assert case.op(op_id) == before, "nothing moved"
    assert case.events(op_id)[-1].event == EventKind.CLAIM.value, "no event for a move that did not happen"
    assert case.attempt(row.attempt_id).attempt_class == "rejected", "the attempt's report is kept"


def test_finalize_guard_passes_once_earlier_attempts_are_proven_unable_to_land(case):
    op_id = case.submit()
    case.add_attempt(op_id, 1, C.AMBIGUOUS)
    case.set(op_id, proven_absent_through=1)
    row = case.claim_one(op_id)
    assert case.finalize(case.write(row, Status.FAILED_BEFORE_COMMIT, C.REJECTED)) == [(True, True)]


def test_finalize_without_the_guard_moves_whatever_earlier_attempts_say(case):
    op_id = case.submit()
    case.add_attempt(op_id, 1, C.AMBIGUOUS)
    row = case.claim_one(op_id)
    assert case.finalize(case.write(row, Status.OUTCOME_UNKNOWN, C.AMBIGUOUS, guard=False)) == [(True, True)]


def test_finalize_with_a_stale_token_writes_the_attempt_report_but_moves_nothing(case):
    row = claimed(case)
    before = case.op(row.id)
    stale = case.write(row, Status.SUCCEEDED, C.SUCCEEDED, reference="re_1", token=row.fencing_token - 1)
    assert case.finalize(stale) == [(True, False)]
    assert case.op(row.id) == before
    assert len(case.events(row.id)) == 2, "submit and claim only"
    attempt = case.attempt(row.attempt_id)
    assert (attempt.attempt_class, attempt.provider_reference) == ("succeeded", "re_1")


def test_finalize_moves_nothing_once_the_row_left_the_source_status(case):
    row = claimed(case)
    case.set(row.id, status=Status.OUTCOME_UNKNOWN.value)  # its lease expired, same token
    assert case.finalize(case.write(row, Status.SUCCEEDED, C.SUCCEEDED, reference="re_1")) == [(True, False)]
    assert case.op(row.id).status == "outcome_unknown"


def test_finalize_writes_an_attempts_report_once(case):
    row = claimed(case)
    assert case.finalize(case.write(row, Status.OUTCOME_UNKNOWN, C.AMBIGUOUS)) == [(True, True)]
    late = case.write(row, Status.SUCCEEDED, C.SUCCEEDED, reference="re_1")
    assert case.finalize(late) == [(False, False)]
    assert case.attempt(row.attempt_id).attempt_class == "ambiguous"


def test_finalize_answers_each_write_of_a_batch_in_order_and_refuses_only_the_stale_one(case):
    rows = [claimed(case) for _ in range(3)]
    writes = [case.write(r, Status.SUCCEEDED, C.SUCCEEDED, reference=f"re_{i}") for i, r in enumerate(rows)]
    writes[1] = case.write(rows[1], Status.SUCCEEDED, C.SUCCEEDED, reference="re_1", token=rows[1].fencing_token + 1)
    assert case.finalize(*writes) == [(True, True), (True, False), (True, True)]
    assert [case.op(r.id).status for r in rows] == ["succeeded", "dispatching", "succeeded"]
    assert case.finalize() == []


def test_finalize_batch_rolls_back_with_the_callers_transaction(case):
    row = claimed(case)
    with case.sessions() as s:
        s.begin()
        assert case.driver.finalize(s, [case.write(row, Status.SUCCEEDED, C.SUCCEEDED, reference="r")]) == [
            (True, True)
        ]
        s.rollback()
    assert case.op(row.id).status == "dispatching"
    assert case.attempt(row.attempt_id).attempt_class == "pending"


# -- a reconciler's settlement (source: the lookup claim's status) -------------------------------------
def looked_up(case: Any, status: Status) -> Any:
    """An operation parked in ``status`` by its dispatch attempt, then claimed for a lookup."""
    row = claimed(case)
    klass = C.ACCEPTED if status is Status.ACCEPTED else C.AMBIGUOUS
    assert case.finalize(case.write(row, status, klass, reference="re_0" if klass is C.ACCEPTED else None)) == [
        (True, True)
    ]
    return case.claim_one(row.id, AttemptKind.LOOKUP, worker="r1")


@pytest.mark.parametrize("source", [Status.OUTCOME_UNKNOWN, Status.ACCEPTED])
def test_finalize_settles_a_lookup_claim_from_its_rows_status_and_keeps_the_dispatch_error(case, source):
    lookup = looked_up(case, source)
    before = case.op(lookup.id)
    write = case.write(lookup, Status.SUCCEEDED, C.SUCCEEDED, result=RESULT, reference="re_9")
    assert case.finalize(write) == [(True, True)]
    op = case.op(lookup.id)
    assert (op.status, op.result_reference, op.result, op.lease_owner) == ("succeeded", "re_9", RESULT, None)
    assert op.error_class is None, "a success clears the class"
    assert op.last_error == before.last_error, "and keeps the dispatch attempt's error: the lookup only explains it"
    assert op.finished_at is not None
    event = case.events(lookup.id)[-1]
    assert (event.from_status, event.to_status, event.event) == (source.value, "succeeded", "lookup result")
    assert case.attempt(lookup.attempt_id).attempt_class == "succeeded"


@pytest.mark.parametrize("source", [Status.OUTCOME_UNKNOWN, Status.ACCEPTED])
def test_finalize_settlement_that_rechecks_later_keeps_the_status_and_reschedules(case, source):
    lookup = looked_up(case, source)
    klass = C.ACCEPTED if source is Status.ACCEPTED else C.AMBIGUOUS
    assert case.finalize(case.write(lookup, source, klass, delay_s=60.0)) == [(True, True)]
    op = case.op(lookup.id)
    assert (op.status, op.lease_owner, op.fencing_token) == (source.value, None, lookup.fencing_token)
    assert abs(case.seconds(op.next_attempt_at, op.updated_at) - 60.0) < 0.5
    assert case.claim(AttemptKind.LOOKUP) == [], "not due again before its re-check"


def test_finalize_settlement_with_a_stale_lookup_token_moves_nothing(case):
    lookup = looked_up(case, Status.OUTCOME_UNKNOWN)
    again = case.write(lookup, Status.SUCCEEDED, C.SUCCEEDED, reference="re_9", token=lookup.fencing_token - 1)
    assert case.finalize(again) == [(True, False)]
    assert case.op(lookup.id).status == "outcome_unknown"


# -- mark_attempt_stale ------------------------------------------------------------------------------
def test_mark_attempt_stale_marks_that_attempt_row_only(case):
    row, other = claimed(case), claimed(case)
    case.finalize(case.write(row, Status.SUCCEEDED, C.SUCCEEDED, reference="re_1", token=row.fencing_token + 1))
    before = case.attempt(row.attempt_id)
    with case.sessions.begin() as s:
        case.driver.mark_attempt_stale(s, row.attempt_id)
    after = case.attempt(row.attempt_id)
    assert after.stale is True
    assert {**after._mapping, "stale": False} == dict(before._mapping), "nothing else changes"
    assert case.attempt(other.attempt_id).stale is False
    assert case.op(row.id).status == "dispatching"
