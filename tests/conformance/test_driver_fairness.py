"""Conformance: a dispatch claim's order, priority and tenant fairness (outbox/ledger/fairness.py).
See conftest.py for how to run this against a new driver.

Every driver ranks the same way: a tenant's due rows in turn (a doorbell's ids first, then higher
priority, then older), the claim taking turns over the tenants' weights, ties in tenant order
after the process's cursor."""

from __future__ import annotations

from collections import Counter
from typing import Any

from outbox.ledger.fairness import Fairness, FairnessMode
from outbox.ledger.states import AttemptKind, Status

DISPATCH = AttemptKind.DISPATCH


def claim(case: Any, fairness: Fairness, *, limit: int = 10, ids: list[str] | None = None, also_due: int = 0) -> list:
    after = fairness.after
    with case.sessions.begin() as s:
        rows = list(
            case.driver.claim(
                s,
                DISPATCH,
                worker="w1",
                lease_s=30.0,
                limit=limit,
                operation_ids=ids,
                also_due=also_due,
                fairness=fairness,
            )
        )
    fairness.advance(after, (r.tenant for r in rows))  # as claims.claim_due does
    return rows


def backlog(case: Any, tenant: str, n: int, *, oldest_s: float = 1000.0) -> list[str]:
    """``n`` due rows of ``tenant`` in one transaction, oldest first, all older than ``oldest_s - n`` s."""
    news = [case.new_operation(tenant=tenant, delay_s=-(oldest_s - i)) for i in range(n)]
    case.within(lambda s: [case.driver.insert_operation(s, new) for new in news])
    return [new.id for new in news]


def test_a_tenants_newer_row_is_claimed_beside_anothers_backlog(case):
    backlog(case, "a", 50)
    b = case.submit(tenant="b", delay_s=-1.0)  # newer than every row of a
    rows = claim(case, Fairness())
    assert len(rows) == 10 and b in [r.id for r in rows]
    assert Counter(r.tenant for r in rows) == {"a": 9, "b": 1}


def test_a_doorbells_ids_alone_are_claimed_as_given(case):
    a = backlog(case, "a", 50)
    case.submit(tenant="b", delay_s=-1.0)
    wanted = a[-10:]  # no also_due: exactly those, whoever else is due (a single-tenant dispatch_one)
    assert {r.id for r in claim(case, Fairness(), ids=wanted, limit=10)} == set(wanted)


def test_a_doorbell_full_of_one_tenants_ids_still_takes_anothers_due_row(case):
    a = backlog(case, "a", 50)
    b = case.submit(tenant="b", delay_s=-1.0)
    wanted = a[-10:]  # a's newest: within a they go first, before a's older rows
    rows = claim(case, Fairness(), ids=wanted[:5], limit=5, also_due=5)  # a batch of 10
    got = [r.id for r in rows]
    assert len(got) == 10 and b in got
    assert [op_id for op_id in got if op_id != b][:5] == wanted[:5], "a's wanted ids take a's first turns"


def test_a_higher_priority_is_claimed_before_older_rows_of_its_tenant(case):
    backlog(case, "a", 20)
    urgent = case.submit(tenant="a", delay_s=-1.0, priority=5)
    low = case.submit(tenant="a", delay_s=-5000.0, priority=-1)  # the oldest, but lower
    for fairness in (Fairness(), Fairness(FairnessMode.OFF)):
        with case.sessions.begin() as s:
            rows = list(
                case.driver.claim(
                    s,
                    DISPATCH,
                    worker="w1",
                    lease_s=30.0,
                    limit=3,
                    operation_ids=None,
                    also_due=0,
                    fairness=fairness,
                )
            )
            assert rows[0].id == urgent and low not in [r.id for r in rows]
            s.rollback()


def test_weights_give_tenants_their_shares(case):
    backlog(case, "acme", 40)
    backlog(case, "globex", 40)
    fairness = Fairness(weights={"acme": 3})
    shares = Counter(r.tenant for _ in range(4) for r in claim(case, fairness, limit=8))
    assert shares == {"acme": 24, "globex": 8}


def test_consecutive_claims_serve_the_tenants_after_the_cursor(case):
    for t in "abcd":
        backlog(case, t, 3)
    fairness = Fairness()
    first = claim(case, fairness, limit=2)
    second = claim(case, fairness, limit=2)
    third = claim(case, fairness, limit=2)
    assert [r.tenant for r in first] == ["a", "b"]
    assert [r.tenant for r in second] == ["c", "d"]
    assert [r.tenant for r in third] == ["a", "b"], "wrapped around"


def test_a_claim_bigger_than_the_tenants_it_walks_moves_the_cursor_past_all_it_served(case):
    # 70 tenants with 2 rows each, claims of 33: PostgreSQL walks 32 tenants a claim, so a claim's last
    # turn is a walked tenant's second row; the cursor must still move past all 32, or the tenants
    # late in the order wait one claim per tenant before them.
    tenants = [f"t{i:02d}" for i in range(70)]
    for t in tenants:
        backlog(case, t, 2)
    fairness = Fairness()
    served = {r.tenant for _ in range(3) for r in claim(case, fairness, limit=33)}
    assert served == set(tenants), f"not served in three claims: {sorted(set(tenants) - served)}"


def test_fairness_off_claims_oldest_first_whoever_the_tenant(case):
    a = backlog(case, "a", 50)
    case.submit(tenant="b", delay_s=-1.0)
    rows = claim(case, Fairness(FairnessMode.OFF))
    assert [r.id for r in rows] == a[:10]


def test_the_relay_rings_higher_priorities_first(case):
    backlog(case, "a", 5)
    urgent = case.submit(tenant="a", delay_s=-1.0, priority=9)
    rows = case.driver.mark_due(
        case.engine,
        Status.NOT_DISPATCHED,
        leased_ok=False,
        batch=1,
        republish_after_s=30.0,
        fresh_grace_s=0.0,
        leading_since=None,
    )
    assert [r[0] for r in rows] == [urgent]
