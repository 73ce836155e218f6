"""The service layer every surface calls (outbox/service/): for one tenant, another tenant's record
does not exist, whichever use case asks; a page of operations is keyset-paged; a settled outcome is
one read, whoever waits. On both ledgers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from outbox.actions.specs import ApprovalSpec
from outbox.errors import HandoffNotFound, InvalidIntent, OperationNotFound, ReportNotFound, RunNotFound
from outbox.evidence.handoffs import open_handoff
from outbox.ledger.models import Operation
from outbox.service import approvals, handoffs, operations, reports, runs, waiting
from producer import submit
from tests.harness import REFUND_ARGS

REFUND = "payments.refund.create"
POLICIES = {REFUND: ApprovalSpec(required="always")}


def _submit(ledger: Any, tenant: str, key: str, *, approval: bool = False) -> str:
    with ledger.sessions.begin() as s:
        receipt = submit(
            s,
            tenant=tenant,
            idempotency_key=key,
            action=REFUND,
            args=REFUND_ARGS,
            subject="t",
            requires_approval=approval,
        )
    return receipt.operation_id


def test_another_tenants_records_are_not_found_by_any_use_case(ledger):
    theirs = _submit(ledger, "b", "k-b", approval=True)
    with ledger.sessions.begin() as s:
        handoff = open_handoff(s, theirs, reason="test", packet={})
    with ledger.sessions.begin() as s:
        for ask in (
            lambda: operations.get(s, "a", theirs),
            lambda: operations.get(s, "a", "not-an-operation-id"),
            lambda: operations.cancel(s, "a", theirs, actor="x", reason="y"),
            lambda: approvals.show(s, "a", theirs),
            lambda: approvals.approve(s, "a", theirs, by="x", note=None, policies=POLICIES),
            lambda: approvals.deny(s, "a", theirs, by="x", note="y"),
        ):
            with pytest.raises(OperationNotFound):
                ask()
        for ask in (
            lambda: handoffs.get(s, "a", handoff),
            lambda: handoffs.get(s, "b", 2**70),  # no BIGINT: never reaches the database
            lambda: handoffs.resolve(s, "a", handoff, resolution="abandoned", by="x", note="y"),
        ):
            with pytest.raises(HandoffNotFound):
                ask()
        with pytest.raises(RunNotFound):
            runs.get(s, "a", str(uuid.uuid4()))
        with pytest.raises(ReportNotFound):
            reports.latest(s, "a")
        assert approvals.pending(s, "a") == [] and handoffs.listing(s, "a") == []
        assert [op.id for op in approvals.pending(s, "b")] == [theirs]
        assert [row.handoff.id for row in handoffs.listing(s, "b")] == [handoff]
        assert operations.get(s, None, theirs).tenant == "b"  # the command line's operator sees every tenant
    with ledger.sessions() as s:
        assert s.get(Operation, theirs).status == "awaiting_approval"  # nothing moved


def test_a_page_is_newest_first_and_its_cursor_continues_where_it_stopped(ledger):
    mine = [_submit(ledger, "a", f"page-{i}") for i in range(5)]
    _submit(ledger, "b", "page-b")
    seen: list[str] = []
    cursor = None
    with ledger.sessions() as s:
        while True:
            found = operations.page(s, "a", cursor=cursor, limit=2)
            seen += [op.id for op in found.operations]
            if found.next_cursor is None:
                break
            cursor = found.next_cursor
        newest_first = [op.id for op in operations.page(s, "a", limit=10).operations]
        assert [op.idempotency_key for op in operations.page(s, "a", search="page-").operations][-1] == "page-0"
        assert operations.page(s, "a", search=mine[2]).operations[0].id == mine[2]
        assert operations.page(s, "a", status="succeeded").operations == []
        for bad in ({"status": "bogus"}, {"cursor": "not-a-cursor"}, {"search": "\x00"}, {"limit": 0}):
            with pytest.raises(InvalidIntent):
                operations.page(s, "a", **bad)
    assert seen == newest_first and sorted(seen) == sorted(mine)


def test_one_read_says_which_outcomes_are_settled_for_every_waiter(ledger):
    waiting_person = _submit(ledger, "a", "w-approval", approval=True)  # settled: a person decides
    queued = _submit(ledger, "a", "w-queued")
    with ledger.sessions() as s:
        assert waiting.settled(s, [waiting_person, queued, str(uuid.uuid4())]) == {waiting_person}
    assert waiting.wait(ledger.sessions, waiting_person, timeout_s=0)
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    assert not waiting.wait(ledger.sessions, queued, timeout_s=1, sleep=sleep, clock=lambda: now[0])
    assert sum(slept) == pytest.approx(1.0) and max(slept) <= waiting.POLL_S
    for bad in (-1, 61, True, "5"):
        with pytest.raises(InvalidIntent):
            waiting.timeout_of(bad)
