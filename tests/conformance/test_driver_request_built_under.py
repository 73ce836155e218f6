"""Conformance: what a request under a key was built under when it was never recorded
(outbox/ledger/request_record.py, migration 0021). A dispatch claim writes its worker's version of the
action on the attempt row it opens, and answers, with nothing on record, the versions of the earlier
attempts that may have reached the provider; a finalize refused for a lost lease still records what
its attempt sent if nothing is on record, and never overwrites a record. See conftest.py for how to
run this against a new driver."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import StaleFence
from outbox.ledger.claims import Claim, claim_due
from outbox.ledger.clock import db_now
from outbox.ledger.leases import expire_leases
from outbox.ledger.request_record import RequestRecord, left_versions
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, commit_even_if_stale, finalize_if_fenced

ACTION = "payments.refund.create"
FIRST = RequestRecord("v-first", "POST", "/v1/refunds", '{"amount":"10.00"}', "a" * 64, "idempotency-key")
LATER = RequestRecord("v-later", "PUT", "/v2/refunds", '{"amount":10}', "b" * 64, "")


def recorded(op: Any) -> RequestRecord:
    return RequestRecord(
        op.request_version,
        op.request_method,
        op.request_path,
        op.request_body,
        op.request_digest,
        op.request_key_header,
    )


def claim_under(case: Any, op_id: str, version: str | None) -> Any:
    """A worker's dispatch claim of ``op_id``, holding ``version`` of its action (and another action's)."""
    versions = {"other.action": "v-other"} | ({ACTION: version} if version else {})
    return case.claim_one(op_id, versions=versions)


def due_again(case: Any, op_id: str, **values: Any) -> None:
    """The operation back in not_dispatched and due, as a lookup's "not found" leaves it."""
    case.set(op_id, status=Status.NOT_DISPATCHED.value, next_attempt_at=db_now(-1), lease_expires_at=None, **values)


def test_a_dispatch_claim_writes_its_workers_version_of_the_action_on_the_attempt_row(case):
    op_id = case.submit(action_version=None)
    row = claim_under(case, op_id, "v1")
    assert case.attempt(row.attempt_id).action_version == "v1"
    assert row.left_versions is None, "a first attempt: nothing before it"
    due_again(case, op_id)
    unknown = claim_under(case, op_id, None)  # a worker without the action: nothing is written
    assert case.attempt(unknown.attempt_id).action_version is None
    plain = case.submit()
    assert case.attempt(case.claim_one(plain).attempt_id).action_version is None  # no versions given


def test_a_claim_after_refunded_attempts_only_reads_nothing_more(case):
    # Refunded attempts sent nothing (a breaker, a limit, an approval...): the count stays at 1, and
    # the claim does not look for earlier attempts that may have left (a first attempt's cost).
    op_id = case.submit(action_version=None)
    first = claim_under(case, op_id, "v1")
    refunded = case.write(first, Status.NOT_DISPATCHED, AttemptClass.NOT_SENT, refund=True)
    assert case.finalize(refunded) == [(True, True)]
    again = claim_under(case, op_id, "v2")
    assert (again.attempt_count, again.number, again.left_versions) == (1, 2, None)


def test_with_nothing_on_record_a_claim_answers_the_versions_of_the_attempts_that_may_have_left(case):
    op_id = case.submit(action_version=None)
    first = claim_under(case, op_id, "v1")
    assert case.finalize(case.write(first, Status.NOT_DISPATCHED, AttemptClass.NOT_SENT)) == [(True, True)]

    second = claim_under(case, op_id, "v2")
    assert second.left_versions is None, "not_sent cannot have reached the provider"
    due_again(case, op_id)  # its worker died after the send: attempt 2 stays pending, nothing on record

    third = claim_under(case, op_id, "v3")
    assert left_versions(third.left_versions) == {"v2"}
    assert case.finalize(case.write(third, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS)) == [(True, True)]
    due_again(case, op_id)

    fourth = claim_under(case, op_id, "v3")
    assert left_versions(fourth.left_versions) == {"v2", "v3"}
    due_again(case, op_id, proven_absent_through=3)  # a fenced lookup (or a person) proved 1-3 absent

    fifth = claim_under(case, op_id, "v3")
    assert left_versions(fifth.left_versions) == {"v3"}, "attempt 4 (pending) only"
    write = case.write(fifth, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS)
    assert case.finalize(replace(write, params={**write.params, **FIRST.params()})) == [(True, True)]
    due_again(case, op_id)
    sixth = claim_under(case, op_id, "v4")
    assert sixth.left_versions is None, "a request on record: it is sent again, whatever was claimed before"
    assert RequestRecord.of_row(sixth) == FIRST


def test_an_attempt_claimed_before_0021_counts_as_built_under_the_version_at_submit(case):
    submitted = case.submit(action_version="v-submit")
    case.add_attempt(submitted, 1, AttemptClass.AMBIGUOUS)  # no action_version: an older worker's
    case.set(submitted, attempt_count=1)  # as its claim counted it
    assert left_versions(claim_under(case, submitted, "v-now").left_versions) == {"v-submit"}
    unknown = case.submit(action_version=None)
    case.add_attempt(unknown, 1, AttemptClass.PENDING)
    case.set(unknown, attempt_count=1)
    assert left_versions(claim_under(case, unknown, "v-now").left_versions) == {None}


def test_record_request_writes_only_where_nothing_is_on_record_on_every_access_path(access):
    op_id = access.submit(action_version=None)
    assert access.within(lambda s: access.driver.record_request(s, op_id, FIRST.params()))
    assert not access.within(lambda s: access.driver.record_request(s, op_id, LATER.params()))
    op = access.op(op_id)
    assert recorded(op) == FIRST and op.action_version == "v-first", "first wins; the version it was built under"
    assert op.status == "not_dispatched", "the record only: whatever the status, nothing moves"


def _claim(case: Any, op_id: str, worker: str, version: str) -> Claim:
    with case.sessions.begin() as s:
        (claim,) = claim_due(s, worker=worker, lease_s=30, operation_id=op_id, versions={ACTION: version})
    return claim


def _lose_lease(case: Any, op_id: str) -> None:
    """Its lease runs out and the sweep moves it to outcome_unknown: its worker's token is stale."""
    case.set(op_id, lease_expires_at=db_now(-1))
    with case.sessions.begin() as s:
        assert op_id in expire_leases(s)


def _finalize(case: Any, claim: Claim, sent: RequestRecord) -> bool:
    """The claim's finalize (an ambiguous answer) reporting ``sent``; False when refused as stale."""

    def write(s: Session) -> None:
        report = AttemptReport(AttemptClass.AMBIGUOUS, sent=sent)
        finalize_if_fenced(s, claim, report, to=Status.OUTCOME_UNKNOWN, reason="read timeout")

    try:
        commit_even_if_stale(case.sessions, write)
    except StaleFence:
        return False
    return True


def test_a_finalize_refused_for_a_lost_lease_records_what_left_if_nothing_is_on_record(case):
    op_id = case.submit(action_version=None)
    frozen = _claim(case, op_id, "w1", "v-first")
    _lose_lease(case, op_id)
    assert not _finalize(case, frozen, FIRST), "its lease is lost: the move is refused"
    op = case.op(op_id)
    assert op.status == "outcome_unknown"
    assert recorded(op) == FIRST, "what left is a fact about the provider: recorded all the same"
    assert op.action_version == "v-first"
    assert case.attempt(frozen.attempt_id).stale


def test_a_refused_finalize_never_overwrites_a_record_either_way_round(case):
    # The frozen worker reports after its successor recorded its own request: the record stays.
    later_first = case.submit(action_version="v-submit")
    frozen = _claim(case, later_first, "w1", "v-first")
    _lose_lease(case, later_first)
    due_again(case, later_first)
    successor = _claim(case, later_first, "w2", "v-later")
    assert _finalize(case, successor, LATER)
    assert not _finalize(case, frozen, FIRST)
    assert recorded(case.op(later_first)) == LATER and case.op(later_first).action_version == "v-submit"

    # The frozen worker reports first: its successor claims the request on record, and keeps it.
    first_first = case.submit(action_version=None)
    frozen = _claim(case, first_first, "w1", "v-first")
    _lose_lease(case, first_first)
    assert not _finalize(case, frozen, FIRST)
    due_again(case, first_first)
    successor = _claim(case, first_first, "w2", "v-later")
    assert successor.sent == FIRST and successor.left_under == frozenset()
    assert _finalize(case, successor, LATER)
    assert recorded(case.op(first_first)) == FIRST


def test_a_refused_finalize_records_no_path_or_body_of_purged_arguments(case):
    op_id = case.submit(action_version=None)
    frozen = _claim(case, op_id, "w1", "v-first")
    _lose_lease(case, op_id)
    case.set(op_id, args=None)  # retention took the arguments meanwhile
    assert not _finalize(case, frozen, FIRST)
    assert recorded(case.op(op_id)) == replace(FIRST, path=None, body=None)


def test_nothing_sent_records_nothing_even_when_refused(case):
    op_id = case.submit(action_version=None)
    frozen = _claim(case, op_id, "w1", "v-first")
    _lose_lease(case, op_id)

    def write(s: Session) -> None:
        finalize_if_fenced(s, frozen, AttemptReport(AttemptClass.NOT_SENT), to=Status.NOT_DISPATCHED, reason="x")

    try:
        commit_even_if_stale(case.sessions, write)
    except StaleFence:
        pass
    assert recorded(case.op(op_id)) == RequestRecord(None)
