"""Conformance: what the relay asks of a driver (mark_due, mark_rung, listener). See conftest.py for
how to run this against a new driver."""

from __future__ import annotations

from typing import Any

import pytest

from outbox.ledger.clock import db_now
from outbox.ledger.states import AttemptClass, AttemptKind, Status


def mark(case: Any, status: Status = Status.NOT_DISPATCHED, **kw: Any) -> list[Any]:
    options: dict[str, Any] = dict(
        leased_ok=False, batch=100, republish_after_s=60.0, fresh_grace_s=0.0, leading_since=None
    )
    return list(case.driver.mark_due(case.engine, status, **(options | kw)))


def marked(case: Any, status: Status = Status.NOT_DISPATCHED, **kw: Any) -> set[str]:
    return {row[0] for row in mark(case, status, **kw)}


def test_mark_due_marks_due_rows_published_in_its_own_transaction_and_says_how_long_each_was_due(case):
    old, fresh, later = case.submit(delay_s=-30), case.submit(), case.submit(delay_s=60)
    rows = mark(case)
    assert {r[0] for r in rows} == {old, fresh}, "a row not due yet is left alone"
    age = {r[0]: r[1] for r in rows}
    assert 29 < age[old] < 35 and 0 <= age[fresh] < 5
    now = case.db_time()
    assert all(-5 < case.seconds(case.op(i).published_at, now) <= 0 for i in (old, fresh))
    assert case.op(later).published_at is None
    assert marked(case) == set(), "published: not rung again inside republish_after_s"


def test_mark_due_without_writing_answers_the_same_rows_in_order_and_marks_none(case):
    """``write=False``: what a relay ringing by count reads (workers/relay/loop.py): the rows a
    marking call would take, oldest first, up to the batch, with nothing written."""
    old, fresh, later = case.submit(delay_s=-30), case.submit(), case.submit(delay_s=60)
    rows = mark(case, write=False)
    assert [r[0] for r in rows] == [old, fresh], "a row not due yet is left alone; the oldest first"
    assert 29 < rows[0][1] < 35
    assert [r[0] for r in mark(case, write=False, batch=1)] == [old]
    assert all(case.op(i).published_at is None for i in (old, fresh, later)), "nothing marked"
    assert marked(case) == {old, fresh}, "so a marking call still takes them"


def test_mark_due_rings_again_a_row_due_again_since_and_one_rung_too_long_ago(case):
    retried, lost, rung = case.submit(), case.submit(), case.submit()
    assert marked(case) == {retried, lost, rung}
    # Due again after its doorbell (a retry), both in the past: SQLite's clock counts milliseconds,
    # and a retry due 1 ms ahead was not due yet when the next call came within that millisecond.
    case.set(retried, published_at=db_now(-1), next_attempt_at=db_now(-0.5))
    case.set(lost, published_at=db_now(-120))  # its message was lost
    assert marked(case, republish_after_s=60.0) == {retried, lost}


def test_mark_due_takes_up_to_batch_rows_oldest_first(case):
    ops = case.submit_many(5)
    assert marked(case, batch=2) == set(ops[:2])
    assert marked(case, batch=10) == set(ops[2:])


def test_mark_due_marks_only_rows_of_the_status_asked_for(case):
    due = case.submit()
    unknown = case.submit()
    claimed = case.claim_one(unknown)
    case.finalize(case.write(claimed, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS))
    assert marked(case, Status.OUTCOME_UNKNOWN, leased_ok=True) == {unknown}
    assert marked(case, Status.NOT_DISPATCHED) == {due}


@pytest.mark.parametrize("leased_ok", [True, False])
def test_mark_due_skips_rows_under_a_live_lease_unless_leased_ok(case, leased_ok):
    op_id = case.submit()
    claimed = case.claim_one(op_id)
    case.finalize(case.write(claimed, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS))
    case.claim_one(op_id, AttemptKind.LOOKUP)  # a lookup under way holds the row under its lease
    assert marked(case, Status.OUTCOME_UNKNOWN, leased_ok=leased_ok) == ({op_id} if leased_ok else set())


def test_mark_due_leaves_fresh_rows_to_the_notify_path_where_the_database_notifies(case):
    """``fresh_grace_s``: rows never rung and due for less than it are the NOTIFY path's, unless
    they were due before ``leading_since`` (when this relay began ringing from NOTIFY). A driver
    without NOTIFY has no such path: every due row is marked."""
    fresh, old = case.submit(), case.submit(delay_s=-30)
    if not case.expect.fresh_grace:
        assert marked(case, fresh_grace_s=10.0) == {fresh, old}
        return
    assert marked(case, fresh_grace_s=10.0) == {old}
    assert marked(case, fresh_grace_s=10.0, leading_since=case.db_time()) == {fresh}
    # A retry coming due was claimed before: no NOTIFY announces it, so no grace holds it back.
    retried = case.submit()
    case.finalize(case.write(case.claim_one(retried), Status.NOT_DISPATCHED, AttemptClass.NOT_SENT))
    assert case.op(retried).published_at is None
    assert marked(case, fresh_grace_s=10.0, write=False) == {retried}


def test_mark_rung_marks_never_published_not_dispatched_rows_only(case):
    rung, published, unknown = case.submit(), case.submit(delay_s=-300), case.submit()
    case.set(published, published_at=db_now(-299))  # rung once it came due
    case.finalize(case.write(case.claim_one(unknown), Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS))
    before = case.op(published).published_at
    case.driver.mark_rung(case.engine, [rung, published, unknown, "no-such-operation"])
    assert case.op(rung).published_at is not None
    assert case.op(published).published_at == before, "an older doorbell is not overwritten"
    assert case.op(unknown).published_at is None
    assert marked(case, republish_after_s=3600) == set(), "rung: the tick does not ring it again"
    case.driver.mark_rung(case.engine, [])


def test_listener_hears_notified_ids_and_one_listener_leads_at_a_time_where_the_database_notifies(case):
    first, second = case.driver.listener(case.engine), case.driver.listener(case.engine)
    if not case.expect.notifies:
        assert first is None and second is None, "nothing notifies: the relay polls"
        return
    with first.connected():
        assert first.fileno() >= 0 and first.drain() == []
        with second.connected():
            since = first.try_lead()
            assert since is not None and abs(case.seconds(since, case.db_time())) < 5, "the database's time"
            assert second.try_lead() is None, "the NOTIFY-leader lock is held"
            op_id = case.submit()
            assert case.heard(first, {op_id}) == [op_id] and case.heard(second, {op_id}) == [op_id]
        assert isinstance(first.errors, tuple)
    with second.connected():
        assert second.try_lead() is not None, "the lock went with the leader's connection"
