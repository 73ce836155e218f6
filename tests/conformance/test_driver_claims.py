"""Conformance: claim, for a worker (dispatch) and for the reconciler (lookup). See conftest.py for
how to run this against a new driver."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from outbox.ledger.clock import db_now
from outbox.ledger.drivers import ClaimedRow
from outbox.ledger.states import AttemptClass, AttemptKind, EventKind, Status, WaitingFor

DISPATCH, LOOKUP = AttemptKind.DISPATCH, AttemptKind.LOOKUP


def ids(rows: Any) -> list[str]:
    return [r.id for r in rows]


def parked_unknown(case: Any, op_id: str, *, status: Status = Status.OUTCOME_UNKNOWN) -> Any:
    """``op_id`` claimed by a worker and finalized into ``status`` (an ambiguous or accepted answer),
    due for a lookup now; the claimed row."""
    claimed = case.claim_one(op_id)
    klass = AttemptClass.ACCEPTED if status is Status.ACCEPTED else AttemptClass.AMBIGUOUS
    assert case.finalize(case.write(claimed, status, klass)) == [(True, True)]
    return claimed


# -- dispatch --------------------------------------------------------------------------------------
def test_claim_returns_rows_with_every_claimed_row_field(case):
    op_id = case.submit()
    (row,) = case.claim()
    missing = [name for name in ClaimedRow._fields if not hasattr(row, name)]
    assert missing == [] and row.id == op_id


def test_claim_moves_a_due_row_to_dispatching_under_a_lease_with_the_token_bumped_by_one(case):
    op_id = case.submit(max_attempts=5, deadline_s=300.0)
    case.set(op_id, waiting_for=WaitingFor.BACKOFF.value)
    before = case.op(op_id)
    (row,) = case.claim(worker="w7", lease_s=45)
    after = case.op(op_id)
    assert (after.status, after.lease_owner, after.reason, after.waiting_for) == ("dispatching", "w7", "claimed", None)
    assert after.fencing_token == before.fencing_token + 1 == row.fencing_token
    assert after.attempt_count == before.attempt_count + 1 == row.attempt_count
    assert abs(case.seconds(after.lease_expires_at, after.updated_at) - 45) < 0.5, "lease_s from the claim's time"
    assert (row.status, row.tenant, row.idempotency_key, row.provider_key) == (
        "dispatching",
        before.tenant,
        before.idempotency_key,
        before.provider_key,
    )
    assert (row.action, row.args, row.args_digest, row.subject) == (
        before.action,
        before.args,
        before.args_digest,
        before.subject,
    )
    assert (row.max_attempts, row.cancel_requested, row.proven_absent_through) == (5, False, 0)
    assert case.seconds(row.lease_expires_at, after.lease_expires_at) == 0
    assert case.seconds(row.updated_at, after.updated_at) == 0, "updated_at: the claim's own time"
    assert case.seconds(row.created_at, before.created_at) == 0
    assert case.seconds(row.deadline_at, before.deadline_at) == 0


def test_claim_opens_a_pending_attempt_row_numbered_after_the_kinds_last_and_an_event_row(case):
    op_id = case.submit()
    case.add_attempt(op_id, 1, AttemptClass.NOT_SENT)
    case.add_attempt(op_id, 2, AttemptClass.NOT_SENT)
    case.add_attempt(op_id, 1, AttemptClass.SUCCEEDED, AttemptKind.LOOKUP)  # another kind's numbering
    row = case.claim_one(op_id, worker="w7")
    assert row.number == 3
    attempt = case.attempt(row.attempt_id)
    assert (attempt.operation_id, attempt.attempt_number, attempt.kind) == (op_id, 3, "dispatch")
    assert (attempt.fencing_token, attempt.worker, attempt.attempt_class) == (row.fencing_token, "w7", "pending")
    assert attempt.ended_at is None and attempt.stale is False
    assert abs(case.seconds(row.updated_at, attempt.started_at)) < 1
    event = case.events(op_id)[-1]
    assert (event.from_status, event.to_status, event.event) == ("not_dispatched", "dispatching", EventKind.CLAIM.value)
    assert (event.fencing_token, event.reason, event.actor) == (row.fencing_token, "dispatch attempt 3", "w7")


def test_claim_takes_up_to_limit_due_rows_oldest_first(case):
    ops = case.submit_many(5)
    assert sorted(ids(case.claim(limit=2))) == sorted(ops[:2])
    assert sorted(ids(case.claim(limit=10))) == sorted(ops[2:])
    assert case.claim(limit=10) == [], "nothing is claimed twice"


def test_claim_respects_the_due_time_even_for_given_ids(case):
    later = case.submit(delay_s=60)
    assert case.claim() == []
    assert case.claim(ids=[later], limit=1) == []
    case.set(later, next_attempt_at=db_now(-0.01))
    assert ids(case.claim(ids=[later], limit=1)) == [later]


def test_claim_takes_only_not_dispatched_rows_for_a_dispatch(case):
    waiting = case.submit(status=Status.AWAITING_APPROVAL, waiting_for=WaitingFor.APPROVAL)
    unknown = case.submit()
    parked_unknown(case, unknown)
    assert case.claim() == []
    assert case.claim(ids=[waiting, unknown], limit=2) == []


def test_claim_takes_given_ids_first_then_tops_up_with_the_oldest_other_due_rows(case):
    ops = case.submit_many(6)
    given = [ops[5], ops[4]]  # the newest due rows: still taken first
    rows = case.claim(ids=given, limit=2, also_due=3)
    assert sorted(ids(rows[:2])) == sorted(given)
    assert sorted(ids(rows[2:])) == sorted(ops[:3])
    assert ids(case.claim(ids=[ops[4]], limit=1, also_due=10)) == [ops[3]], "claimed ids are not claimed again"


def test_claim_with_given_ids_and_no_top_up_takes_only_those_ids(case):
    ops = case.submit_many(3)
    assert ids(case.claim(ids=[ops[2]], limit=1, also_due=0)) == [ops[2]]
    assert case.claim(ids=[], limit=1, also_due=0) == []


def test_claim_tops_up_with_rows_other_than_the_given_ids_beyond_the_limit(case):
    """``limit`` caps the given ids, ``also_due`` the others: a given id over the limit is not
    taken along as one of the others."""
    ops = case.submit_many(4)
    rows = case.claim(ids=ops[:3], limit=1, also_due=5)
    assert ids(rows[:1]) == [ops[0]], "the oldest due of the given ids"
    assert ids(rows[1:]) == [ops[3]]


def test_claim_never_hands_one_row_to_two_claimers_at_once(case):
    ops = case.submit_many(4)
    first_holds = threading.Event()
    second: list[Any] = []

    def claim_second() -> None:
        first_holds.wait()
        second.extend(case.claim(limit=4, worker="w2"))

    other = threading.Thread(target=claim_second)
    other.start()
    with case.sessions.begin() as s:
        first = list(case.driver.claim(s, DISPATCH, worker="w1", lease_s=30, limit=2, operation_ids=None, also_due=0))
        first_holds.set()
        other.join(0.3)  # the other claimer runs (or waits for us) while we hold our rows
    other.join(10)
    assert not set(ids(first)) & set(ids(second))
    assert sorted(ids(first) + ids(second)) == sorted(ops)


# -- lookup ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [Status.OUTCOME_UNKNOWN, Status.ACCEPTED])
def test_lookup_claim_keeps_the_rows_status_bumps_the_token_and_takes_a_lease(case, status):
    op_id = case.submit()
    parked_unknown(case, op_id, status=status)
    before = case.op(op_id)
    (row,) = case.claim(LOOKUP, worker="r1", lease_s=20)
    after = case.op(op_id)
    assert row.status == after.status == status.value
    assert after.fencing_token == before.fencing_token + 1 == row.fencing_token
    assert after.attempt_count == before.attempt_count == row.attempt_count, "a lookup sends nothing"
    assert (after.reason, after.waiting_for, after.lease_owner) == (before.reason, before.waiting_for, "r1")
    assert abs(case.seconds(after.lease_expires_at, after.updated_at) - 20) < 0.5
    event = case.events(op_id)[-1]
    assert (event.from_status, event.to_status, event.event) == (
        status.value,
        status.value,
        EventKind.RECONCILE_CLAIM.value,
    )
    assert (event.fencing_token, event.reason, event.actor) == (row.fencing_token, "lookup attempt 1", "r1")


def test_lookup_claim_numbers_its_attempt_rows_apart_from_the_dispatch_attempts(case):
    op_id = case.submit()
    case.add_attempt(op_id, 1, AttemptClass.NOT_SENT)
    parked_unknown(case, op_id)  # dispatch attempt 2
    row = case.claim_one(op_id, LOOKUP)
    attempt = case.attempt(row.attempt_id)
    assert (row.number, attempt.attempt_number, attempt.kind, attempt.attempt_class) == (1, 1, "lookup", "pending")
    assert attempt.fencing_token == row.fencing_token


def test_lookup_claim_skips_rows_under_a_live_lease_and_takes_them_once_it_expired(case):
    op_id = case.submit()
    parked_unknown(case, op_id)
    case.claim_one(op_id, LOOKUP)
    assert case.claim(LOOKUP) == [] and case.claim(LOOKUP, ids=[op_id], limit=1) == []
    case.set(op_id, lease_expires_at=db_now(-1))
    assert ids(case.claim(LOOKUP, ids=[op_id], limit=1)) == [op_id]


def test_lookup_claim_respects_the_due_time_and_takes_only_rows_awaiting_an_outcome(case):
    later, due, fresh = case.submit(), case.submit(), case.submit()
    parked_unknown(case, later)
    parked_unknown(case, due)
    case.set(later, next_attempt_at=db_now(60))
    assert ids(case.claim(LOOKUP, ids=[later, due, fresh], limit=3)) == [due]


def test_lookup_claim_takes_given_ids_first_then_tops_up_with_other_due_rows(case):
    ops = case.submit_many(4)
    for op_id in ops:
        parked_unknown(case, op_id)
    rows = case.claim(LOOKUP, ids=[ops[3]], limit=1, also_due=2)
    assert ids(rows[:1]) == [ops[3]]
    assert len(rows) == 3 and ops[3] not in ids(rows[1:])


# -- open_ambiguity --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("earlier", "proven_absent_through", "ambiguous"),
    [
        ([], 0, False),
        ([(DISPATCH, AttemptClass.NOT_SENT), (DISPATCH, AttemptClass.REJECTED)], 0, False),
        ([(DISPATCH, AttemptClass.AMBIGUOUS)], 0, True),
        ([(DISPATCH, AttemptClass.PENDING)], 0, True),  # its worker never reported back
        ([(DISPATCH, AttemptClass.AMBIGUOUS)], 1, False),  # proven unable to land
        ([(DISPATCH, AttemptClass.AMBIGUOUS), (DISPATCH, AttemptClass.AMBIGUOUS)], 1, True),
        ([(LOOKUP, AttemptClass.SUCCEEDED)], 0, True),  # a confirmation of any kind
        ([(DISPATCH, AttemptClass.SUCCEEDED)], 5, True),  # proof of absence never hides a confirmation
        ([(LOOKUP, AttemptClass.AMBIGUOUS)], 0, False),  # a lookup sends nothing that could land
    ],
)
def test_claim_says_whether_an_earlier_attempt_may_have_taken_effect(case, earlier, proven_absent_through, ambiguous):
    op_id = case.submit()
    numbers = {DISPATCH: 0, LOOKUP: 0}
    for kind, klass in earlier:
        numbers[kind] += 1
        case.add_attempt(op_id, numbers[kind], klass, kind)
    case.set(op_id, proven_absent_through=proven_absent_through)
    row = case.claim_one(op_id)
    assert row.open_ambiguity is ambiguous, "the attempt this claim opens never counts"
    assert row.proven_absent_through == proven_absent_through
