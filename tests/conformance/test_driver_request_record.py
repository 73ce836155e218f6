"""Conformance: the request on record under an operation's key (outbox/ledger/request_record.py),
written by the finalize of the first attempt that left and never overwritten; the action's version
written by the submit, or by that finalize when the submit had none. See conftest.py for how to run
this against a new driver."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from outbox.evidence.settlement import resolve_by_person
from outbox.ledger.claims import claim_due
from outbox.ledger.request_record import NO_RECORD, RequestRecord
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.privacy.retention import purge

FIRST = RequestRecord("v-first", "POST", "/v1/refunds?v=1", '{"amount":"10.00"}', "a" * 64)
LATER = RequestRecord("v-later", "PUT", "/v2/refunds", '{"amount":10}', "b" * 64)


def recorded(op: Any) -> RequestRecord:
    return RequestRecord(op.request_version, op.request_method, op.request_path, op.request_body, op.request_digest)


def with_record(write: Any, record: RequestRecord | None) -> Any:
    return replace(write, params={**write.params, **(record.params() if record else NO_RECORD)})


def test_the_first_request_that_left_is_recorded_and_never_overwritten(case):
    op_id = case.submit(action_version=None)
    first = case.claim_one(op_id)
    not_sent = with_record(case.write(first, Status.NOT_DISPATCHED, AttemptClass.NOT_SENT), None)
    assert case.finalize(not_sent) == [(True, True)]
    assert (case.op(op_id).request_version, case.op(op_id).action_version) == (None, None)

    second = case.claim_one(op_id)
    assert (second.request_version, second.request_method) == (None, None)
    left = with_record(case.write(second, Status.NOT_DISPATCHED, AttemptClass.NOT_PROCESSED), FIRST)
    assert case.finalize(left) == [(True, True)]
    op = case.op(op_id)
    assert recorded(op) == FIRST
    assert op.action_version == "v-first", "an operation without a version at submit takes the first request's"

    third = case.claim_one(op_id)
    assert RequestRecord.of_row(third) == FIRST and third.action_version == "v-first"
    again = with_record(case.write(third, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS), LATER)
    assert case.finalize(again) == [(True, True)]
    assert recorded(case.op(op_id)) == FIRST and case.op(op_id).action_version == "v-first"


def test_a_batch_records_each_operations_own_request_and_the_version_at_submit_stays(case):
    ids = [case.submit(action_version=f"v-submit-{i}") for i in range(3)]
    rows = {row.id: row for row in case.claim(ids=ids, limit=3)}
    assert {row.action_version for row in rows.values()} == {"v-submit-0", "v-submit-1", "v-submit-2"}
    records = {op_id: replace(LATER, path=f"/v2/refunds/{i}") for i, op_id in enumerate(ids)}
    writes = [
        with_record(case.write(rows[op_id], Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS), records[op_id])
        for op_id in ids
    ]
    assert case.finalize(*writes) == [(True, True)] * 3  # alike: one statement where the driver can
    for i, op_id in enumerate(ids):
        op = case.op(op_id)
        assert recorded(op) == records[op_id] and op.action_version == f"v-submit-{i}"


def test_a_success_keeps_the_request_but_not_its_body_and_retention_purges_path_and_body(case):
    op_id = case.submit(action_version="v-first")
    with case.sessions.begin() as s:
        (claim,) = claim_due(s, worker="w1", lease_s=30, operation_id=op_id)
        report = AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_1", sent=FIRST)
        finalize_if_fenced(s, claim, report, to=Status.SUCCEEDED, reason="provider confirmed")
    assert recorded(case.op(op_id)) == replace(FIRST, body=None), "nothing is sent under the key after a success"

    purge(case.sessions, older_than_s=-60)
    op = case.op(op_id)
    assert (op.args, op.request_path, op.request_body) == (None, None, None)
    assert (op.request_version, op.request_method, op.request_digest) == ("v-first", "POST", "a" * 64)


def test_a_persons_not_executed_clears_the_record_for_a_first_request_again(case):
    op_id = case.submit(action_version="v-first")
    claimed = case.claim_one(op_id)
    assert case.finalize(with_record(case.write(claimed, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS), FIRST))
    case.set(op_id, status=Status.RECONCILIATION_REQUIRED.value)

    def resolve(s: Session) -> Status:
        return resolve_by_person(s, op_id, outcome="not-executed", by="ops", note="nothing at the provider")

    assert case.within(resolve) is Status.NOT_DISPATCHED
    op = case.op(op_id)
    assert recorded(op) == RequestRecord(None) and op.action_version == "v-first"
