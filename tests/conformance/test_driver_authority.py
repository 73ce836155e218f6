"""Conformance: authority re-checked when work continues, on every driver. See conftest.py for how to
run this against a new driver.

A claim says who submitted what it took (``submitted_by``: the send checks that key); an emergency
stop holds a subject's queued rows out of every claim and a resume makes them due; a worker's hold and
a resume cannot cross (the stop's row is share-locked by the hold); a revocation cancels or parks its
key's queued rows in its own transaction; a stopped subject's new intent is refused at submit.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import func, select

from outbox.access.revocation import revoke
from outbox.errors import SubjectStopped
from outbox.ledger import stops
from outbox.ledger.authority import SETTLE_S, board_for
from outbox.ledger.states import AttemptClass, AttemptKind, EventKind, Status, WaitingFor
from producer import submit
from tests.conformance.conftest import EV

YEAR_S = 300 * 86400.0  # "held": due no sooner than this (stops.HOLD_S is a year)


@pytest.fixture(autouse=True)
def fresh_board(case: Any) -> None:
    """Each test reads who may act afresh: another test's stop must not linger in this process."""
    board_for(case.engine).forget()


def _stop(case: Any, subject: str = "agent:bad", tenant: str = "t") -> tuple[Any, bool, int]:
    with case.sessions.begin() as s:
        return stops.stop(s, tenant=tenant, subject=subject, by="alice", reason="looping")


def _resume(case: Any, subject: str = "agent:bad", tenant: str = "t") -> tuple[Any, int]:
    with case.sessions.begin() as s:
        return stops.resume(s, tenant=tenant, subject=subject, by="bob")


def test_claim_returns_who_submitted_each_row(case):
    mine = case.submit(submitted_by="key:7")
    theirs = case.submit()
    rows = {r.id: r for r in case.claim(limit=10)}
    assert rows[mine].submitted_by == "key:7" and rows[theirs].submitted_by is None


def test_a_stop_holds_the_subjects_queued_rows_out_of_every_claim_and_a_resume_makes_them_due(case):
    bad = [case.submit(subject="agent:bad", delay_s=-1.0) for _ in range(3)]
    later = case.submit(subject="agent:bad", delay_s=30.0)  # a retry's backoff: held too
    good = case.submit(subject="agent:good", delay_s=-1.0)
    other_tenant = case.submit(subject="agent:bad", tenant="t2", delay_s=-1.0)
    held, new, count = _stop(case)
    assert new and count == 4 and (held.by, held.reason) == ("alice", "looping")
    for op_id in [*bad, later]:
        row = case.op(op_id)
        assert (row.status, row.waiting_for) == ("not_dispatched", "stopped")
        assert case.seconds(row.next_attempt_at, case.db_time()) > YEAR_S
        assert "stopped by alice" in row.reason and "looping" in row.reason
        assert [e.event for e in case.events(op_id)][-1] == EventKind.SUBJECT_STOPPED.value
    # Nothing of it is due: a claim of everything due takes only the others, and loops over nothing.
    assert sorted(r.id for r in case.claim(limit=10)) == sorted([good, other_tenant])
    assert case.claim(limit=10) == []

    again, new, count = _stop(case)  # stopping it again keeps the first stop
    assert not new and count == 0 and again.at == held.at

    lifted, woken = _resume(case)
    assert lifted is not None and lifted.by == "alice" and woken == 4
    row = case.op(bad[0])
    assert row.waiting_for is None and "resumed by bob" in row.reason
    assert case.seconds(row.next_attempt_at, case.db_time()) <= 0.5
    assert sorted(r.id for r in case.claim(limit=10)) == sorted([*bad, later])
    assert [e.event for e in case.events(bad[0])][-2] == EventKind.SUBJECT_RESUMED.value
    assert _resume(case) == (None, 0)  # nothing left to resume


def test_a_resume_waits_for_a_hold_in_flight_and_then_wakes_what_it_held(case):
    """The worker's hold reads the stop share-locked and holds its operation in that transaction; a
    resume meanwhile waits for that commit, and its wake then finds the held row (never left held)."""
    op_id = case.submit(subject="agent:bad")
    claimed = case.claim_one(op_id)
    _stop(case)
    holding, resumed = threading.Event(), threading.Event()
    done: dict[str, Any] = {}

    def resume() -> None:
        holding.wait(10)
        done["resumed"] = _resume(case)
        resumed.set()

    thread = threading.Thread(target=resume)
    thread.start()
    with case.sessions.begin() as s:
        assert stops.still_stopped(s, "t", "agent:bad") is not None
        holding.set()
        assert not resumed.wait(0.5), "a resume must wait for the hold's transaction"
        write = case.write(claimed, Status.NOT_DISPATCHED, AttemptClass.NOT_SENT, refund=True, delay_s=stops.HOLD_S)
        write.params["waiting_for"] = WaitingFor.STOPPED.value
        assert case.driver.finalize(s, [write]) == [(True, True)]
    thread.join(10)
    lifted, woken = done["resumed"]
    assert lifted is not None and woken == 1
    row = case.op(op_id)
    assert (row.status, row.waiting_for) == ("not_dispatched", None)
    assert case.seconds(row.next_attempt_at, case.db_time()) <= 0.5


def test_a_hold_after_a_resume_finds_no_stop(case):
    _stop(case)
    _resume(case)
    with case.sessions.begin() as s:
        assert stops.still_stopped(s, "t", "agent:bad") is None


def test_a_stopped_subjects_new_intent_is_refused_at_submit_and_a_replay_answered(case):
    def intent(s: Any, key: str, subject: str = "agent:bad") -> Any:
        return submit(s, tenant="t", idempotency_key=key, action="a.b", args={"n": 1}, subject=subject)

    with case.sessions.begin() as s:
        before = intent(s, "k-before")
    _stop(case)
    with pytest.raises(SubjectStopped) as refused, case.sessions.begin() as s:
        intent(s, "k-new")
    assert refused.value.outcome == "REFUSED" and refused.value.stopped_by == "alice"
    assert "stopped by alice" in refused.value.model_message and "Nothing was submitted" in refused.value.model_message
    with case.sessions.begin() as s:
        replay = intent(s, "k-before")  # accepted before the stop: answered as always (held)
        other = intent(s, "k-other", subject="agent:good")
    assert replay.operation_id == before.operation_id and not replay.new and other.new
    assert case.op(before.operation_id).waiting_for == "stopped"


@pytest.mark.parametrize("cancel_queued", [True, False], ids=["cancel-queued", "to-a-person"])
def test_a_revocation_takes_back_its_keys_queued_rows_in_its_own_transaction(case, cancel_queued):
    from outbox.access.keys import create_key

    with case.sessions.begin() as s:
        _, key = create_key(s, tenant="t", scopes=["submit"])
        key_id = key.id
    mine = f"key:{key_id}"
    queued = case.submit(submitted_by=mine)
    waiting = case.submit(submitted_by=mine, status=Status.AWAITING_APPROVAL, waiting_for=WaitingFor.APPROVAL)
    in_doubt = case.submit(submitted_by=mine)
    case.add_attempt(in_doubt, 1, AttemptClass.AMBIGUOUS)  # an earlier attempt that may still land
    in_flight = case.submit(submitted_by=mine)
    case.claim_one(in_flight)
    others = case.submit(submitted_by="key:999999")
    with case.sessions.begin() as s:
        done = revoke(s, key_id, by="alice", cancel_queued=cancel_queued)
    assert done.revocation.identity == mine and done.revocation.by == "alice"
    assert case.op(in_flight).status == "dispatching"  # a call out finishes and settles as usual
    assert (case.op(others).status, case.op(others).waiting_for) == ("not_dispatched", None)
    if cancel_queued:
        assert (done.cancelled, done.cancel_requested, done.parked) == (2, 1, 0)
        assert case.op(queued).status == case.op(waiting).status == "cancelled"
        assert "revoked" in case.op(queued).reason and "--cancel-queued" in case.op(queued).reason
        doubt = case.op(in_doubt)
        assert (doubt.status, doubt.cancel_requested) == ("not_dispatched", True)  # looked up first
        assert [e.event for e in case.events(queued)][-1] == EventKind.KEY_REVOKED.value
    else:
        assert (done.cancelled, done.parked) == (0, 2)
        for op_id in (queued, in_doubt):
            row = case.op(op_id)
            assert (row.status, row.waiting_for) == ("not_dispatched", "authority")
            assert SETTLE_S - 1 < case.seconds(row.next_attempt_at, case.db_time()) <= SETTLE_S
        assert case.op(waiting).status == "awaiting_approval"  # a person decides there already
        assert [r.id for r in case.claim(limit=10)] == [others]  # its own: not due until every worker knows
    with pytest.raises(Exception, match="no active key"), case.sessions.begin() as s:
        revoke(s, key_id, by="alice")


def test_a_lookup_claim_is_not_held_by_a_stop(case):
    """Lookups read what may have happened: a stopped subject's unknown is still settled."""
    op_id = case.submit(subject="agent:bad")
    claimed = case.claim_one(op_id)
    assert case.finalize(case.write(claimed, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS)) == [(True, True)]
    _stop(case)
    (row,) = case.claim(AttemptKind.LOOKUP, limit=5)
    assert row.id == op_id and row.status == "outcome_unknown"


def test_a_stop_of_thousands_of_queued_rows_holds_each_and_records_each_in_the_history(case):
    """One VALUES list per thousand events: PostgreSQL binds at most 65,535 parameters a statement."""
    with case.sessions.begin() as s:
        for _ in range(2100):
            case.driver.insert_operation(s, case.new_operation(subject="agent:flood", delay_s=-1.0))
    _, _, held = _stop(case, "agent:flood")
    assert held == 2100 and case.claim(limit=10) == []
    with case.sessions() as s:
        stopped = s.execute(
            select(func.count()).select_from(EV).where(EV.c.event == EventKind.SUBJECT_STOPPED.value)
        ).scalar_one()
    assert stopped == 2100
    assert _resume(case, "agent:flood")[1] == 2100
