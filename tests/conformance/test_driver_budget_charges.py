"""Conformance: a retry's charge to its conversation's budget (outbox/ledger/budget_charges.py), on
every driver: made once per attempt however often it is asked, only under the claim's current token,
refused (nothing written) when the scope has no room, and never both for two attempts racing for the
last unit. Operations carry their scope through the claim. See conftest.py for how to run this
against a new driver."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import insert, select

from outbox.ledger.budget_charges import STALE, Charged, Spent, charge_attempt, needs_charge
from outbox.ledger.budget_scopes import EVERY_TOOL, ScopeLimit
from outbox.ledger.clock import db_now
from outbox.ledger.models import core_table
from outbox.ledger.scope_models import BudgetCharge, ScopeSpend

SPEND = core_table(ScopeSpend)
CH = core_table(BudgetCharge)
EVERY = ScopeLimit(EVERY_TOOL, max_calls=10, max_retry_billed=1)
OWN = ScopeLimit("payments.refund.create", max_calls=10)


def _opened(case: Any, scope: str, *buckets: str) -> None:
    """The scope's rows as its calls' submits left them (calls charged, no retry yet)."""
    with case.sessions.begin() as s:
        for bucket in buckets:
            s.execute(
                insert(SPEND).values(
                    tenant="t",
                    scope=scope,
                    bucket=bucket,
                    calls=2,
                    amount_micros=0,
                    opened_at=db_now(),
                    updated_at=db_now(),
                )
            )


def _charge(case: Any, row: Any, *, token: int | None = None, budgets: tuple[ScopeLimit, ...] = (EVERY, OWN)) -> Any:
    with case.sessions.begin() as s:
        return charge_attempt(
            s,
            tenant="t",
            scope=row.budget_scope,
            operation_id=row.id,
            attempt_id=row.attempt_id,
            fencing_token=row.fencing_token if token is None else token,
            budgets=budgets,
        )


def _billed(case: Any, scope: str) -> dict[str, int]:
    with case.sessions() as s:
        return dict(s.execute(select(SPEND.c.bucket, SPEND.c.retry_billed).where(SPEND.c.scope == scope)).all())


def _charges(case: Any) -> list[int]:
    with case.sessions() as s:
        return sorted(s.execute(select(CH.c.attempt_id)).scalars())


def test_the_claim_carries_the_scope_and_only_a_scoped_retry_is_charged(case):
    scoped, plain = case.submit(budget_scope="conv-a"), case.submit()
    assert case.claim_one(scoped).budget_scope == "conv-a" and case.claim_one(plain).budget_scope is None
    assert not needs_charge(budget_scope=None, attempt_count=3, budgets=(EVERY,))
    assert not needs_charge(budget_scope="conv-a", attempt_count=1, budgets=(EVERY,)), (
        "a call's first is paid at submit"
    )
    assert not needs_charge(budget_scope="conv-a", attempt_count=2, budgets=())
    assert needs_charge(budget_scope="conv-a", attempt_count=2, budgets=(EVERY,))


def test_an_attempt_is_charged_once_however_often_the_charge_is_asked(case):
    _opened(case, "conv", EVERY_TOOL, OWN.bucket)
    row = case.claim_one(case.submit(budget_scope="conv"))
    first = _charge(case, row)
    assert isinstance(first, Charged) and not first.again
    assert {s.budget.bucket: s.retry_billed for s in first.standings} == {EVERY_TOOL: 1, OWN.bucket: 1}
    again = _charge(case, row)  # its commit's answer was lost: asked again for the same attempt
    assert isinstance(again, Charged) and again.again
    assert _billed(case, "conv") == {EVERY_TOOL: 1, OWN.bucket: 1} and _charges(case) == [row.attempt_id]


def test_a_stale_token_charges_nothing(case):
    _opened(case, "conv", EVERY_TOOL, OWN.bucket)
    op_id = case.submit(budget_scope="conv")
    old = case.claim_one(op_id)
    case.set(op_id, fencing_token=old.fencing_token + 1)  # another worker's claim since
    assert _charge(case, old) is STALE
    assert _billed(case, "conv") == {EVERY_TOOL: 0, OWN.bucket: 0} and _charges(case) == []


def test_a_scope_without_room_refuses_and_writes_nothing(case):
    _opened(case, "conv", EVERY_TOOL, OWN.bucket)
    one, two = (case.claim_one(case.submit(budget_scope="conv")) for _ in range(2))
    assert isinstance(_charge(case, one), Charged)
    refused = _charge(case, two)
    assert isinstance(refused, Spent) and refused.budget == EVERY
    assert "1 of 1 retries used in this conversation" in refused.why and "no further attempt" in refused.why
    assert _billed(case, "conv") == {EVERY_TOOL: 1, OWN.bucket: 1}, "the refused charge took nothing back or more"
    assert _charges(case) == [one.attempt_id]
    none_at_all = ScopeLimit(EVERY_TOOL, max_retry_billed=0)
    assert isinstance(_charge(case, one, budgets=(none_at_all,)), Charged), "an attempt charged before stays charged"


def test_a_bucket_declared_after_the_submit_is_opened_by_the_charge(case):
    row = case.claim_one(case.submit(budget_scope="conv-new"))
    assert isinstance(_charge(case, row, budgets=(OWN,)), Charged)
    assert _billed(case, "conv-new") == {OWN.bucket: 1}


def test_two_attempts_racing_for_the_last_retry_never_both_pass(case):
    for round_ in range(5):
        scope = f"race-{round_}"
        _opened(case, scope, EVERY_TOOL)
        rows = [case.claim_one(case.submit(budget_scope=scope)) for _ in range(2)]
        start, got = threading.Barrier(2), []

        def race(row: Any) -> None:
            start.wait()
            got.append(_charge(case, row, budgets=(EVERY,)))

        threads = [threading.Thread(target=race, args=(row,)) for row in rows]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(type(g).__name__ for g in got) == ["Charged", "Spent"]
        assert _billed(case, scope) == {EVERY_TOOL: 1}
