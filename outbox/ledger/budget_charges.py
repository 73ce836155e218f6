"""Retries charged to a conversation: every dispatch attempt beyond a call's first is charged to its
budget scope right before it leaves; a scope without room sends nothing more.

A call's first attempt is paid at submit (``max_calls``: budget_scopes.py). Until now a call once
accepted kept its own retry budget, so "6 tools x 3 retries = 18 calls" still happened inside one
conversation; ``max_retry_billed`` bounded only what the next call could still be accepted with.
Now each retry is charged to every budget of the call's scope (``retry_billed``), and where one
declares ``max_retry_billed`` and has no room, the attempt does not leave (the worker ends the
operation as the budget would: workers/dispatch/scope_budget.py).

What is charged, and what is not: a dispatch attempt whose budget-counted number (``attempt_count``)
is beyond 1, at the moment it is about to be sent (after its breaker, its limits and its checks let
it through: an attempt sent back for those is refunded and never charged). The same count as a run's
``retries`` (outbox/runs/records.py): attempts after each call's first. Lookups are not charged: a
lookup is a read that cannot make an effect, and it is how an operation in doubt is settled; a
budget that refused it would turn a knowable outcome into a person's work (the reconciler's own
budget, OUTBOX_RECONCILE_MAX_LOOKUPS, bounds them).

**Once per attempt, fenced, all or nothing.** One transaction: a row per attempt in
``outbox_budget_charges`` (keyed by the attempt's id; inserted only while the claim's token is
current and the operation is dispatching), then one conditional upsert per budget (``retry_billed +
1 <= max_retry_billed``: PostgreSQL re-reads the locked row, SQLite has one writer, so two workers on
the last unit cannot both pass). A refusal rolls the savepoint back: nothing charged, nothing sent. A
charge asked again for the same attempt (its commit's answer was lost) finds its row and charges
nothing. A worker that dies between the charge and the send has paid for a request that never left:
the charge errs on the side of the budget, never of the provider. Operations without a scope, and
first attempts, never come here: no statement at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, literal, select
from sqlalchemy.orm import Session

from outbox.ledger.budget_scopes import EVERY_TOOL, ScopeLimit, Standing, standing
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Operation, core_table
from outbox.ledger.scope_models import BudgetCharge, ScopeSpend
from outbox.ledger.states import Status

_OP = core_table(Operation)
_SPEND = core_table(ScopeSpend)
_CH = core_table(BudgetCharge)


@dataclass(frozen=True)
class Charged:
    """The attempt may leave. ``again``: it was charged already (a charge asked twice)."""

    standings: tuple[Standing, ...]
    again: bool = False


@dataclass(frozen=True)
class Spent:
    """A budget of the scope has no room for this retry: nothing was charged, nothing may leave."""

    budget: ScopeLimit
    standings: tuple[Standing, ...]

    @property
    def why(self) -> str:
        """The reason an operation ends with: what was spent, in the conversation's words."""
        b = self.budget
        spent = next((s.retry_billed for s in self.standings if s.budget.bucket == b.bucket), b.max_retry_billed)
        whose = "the conversation's" if b.bucket == EVERY_TOOL else f"the conversation's {b.bucket}"
        return (
            f"{whose} budget is spent: {spent} of {b.max_retry_billed} retries used in {b.where}; "
            "no further attempt is made"
        )


class Stale:
    """The claim's token is no longer current (another worker owns the operation): nothing charged."""


STALE = Stale()


def needs_charge(*, budget_scope: str | None, attempt_count: int, budgets: Sequence[ScopeLimit]) -> bool:
    """Whether an attempt about to leave is charged: a retry (beyond the call's first) of an
    operation in a scope whose action has budgets there."""
    return budget_scope is not None and attempt_count > 1 and bool(budgets)


class _NoRoom(Exception):
    def __init__(self, budget: ScopeLimit) -> None:
        super().__init__(budget.bucket)
        self.budget = budget


def charge_attempt(
    session: Session,
    *,
    tenant: str,
    scope: str,
    operation_id: str,
    attempt_id: int,
    fencing_token: int,
    budgets: Sequence[ScopeLimit],
) -> Charged | Spent | Stale:
    """Charge one retry of this claimed attempt to each of ``budgets``, in the caller's transaction
    (a savepoint: a refusal writes nothing). The module docstring says why it is safe."""
    fenced = (
        select(literal(1))
        .where(
            _OP.c.id == operation_id,
            _OP.c.fencing_token == fencing_token,
            _OP.c.status == Status.DISPATCHING.value,
        )
        .exists()
    )
    row = select(
        literal(attempt_id, _CH.c.attempt_id.type),
        literal(operation_id, _CH.c.operation_id.type),
        literal(tenant, _CH.c.tenant.type),
        literal(scope, _CH.c.scope.type),
        db_now(),
    ).where(fenced)
    insert = (
        driver_for(session)
        .upsert(_CH)
        .from_select(["attempt_id", "operation_id", "tenant", "scope", "charged_at"], row)
        .on_conflict_do_nothing(index_elements=[_CH.c.attempt_id])
        .returning(_CH.c.attempt_id)
    )
    try:
        with session.begin_nested():
            if session.execute(insert).first() is None:
                if session.execute(select(_CH.c.attempt_id).where(_CH.c.attempt_id == attempt_id)).first() is None:
                    return STALE
                return Charged(_standings(session, tenant, scope, budgets), again=True)
            for budget in budgets:
                # A cap of 0 leaves no room at all (the upsert's insert path would check nothing).
                if (
                    budget.max_retry_billed == 0
                    or session.execute(_charge_one(session, tenant, scope, budget)).first() is None
                ):
                    raise _NoRoom(budget)
    except _NoRoom as exc:
        return Spent(exc.budget, _standings(session, tenant, scope, budgets))
    return Charged(_standings(session, tenant, scope, budgets))


def _charge_one(session: Session, tenant: str, scope: str, b: ScopeLimit) -> Any:
    """One budget's retry counter + 1, if it has room (no row yet, a bucket declared after the call's
    submit: made now)."""
    room = [_SPEND.c.retry_billed + 1 <= b.max_retry_billed] if b.max_retry_billed is not None else []
    return (
        driver_for(session)
        .upsert(_SPEND)
        .values(
            tenant=tenant,
            scope=scope,
            bucket=b.bucket,
            calls=0,
            amount_micros=0,
            retry_billed=1,
            opened_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_update(
            index_elements=[_SPEND.c.tenant, _SPEND.c.scope, _SPEND.c.bucket],
            set_={"retry_billed": _SPEND.c.retry_billed + 1, "updated_at": db_now()},
            where=and_(*room) if room else None,
        )
        .returning(_SPEND.c.retry_billed)
    )


def _standings(session: Session, tenant: str, scope: str, budgets: Sequence[ScopeLimit]) -> tuple[Standing, ...]:
    return tuple(standing(session, tenant=tenant, scope=scope, budgets=budgets))


def spent_budget(session: Session, *, tenant: str, scope: str, budgets: Sequence[ScopeLimit]) -> Spent | None:
    """The budget with no room left for another retry, if any (nothing charged): the reconciler asks
    before it sends an operation back to be dispatched again."""
    standings = _standings(session, tenant, scope, budgets)
    for s in standings:
        cap = s.budget.max_retry_billed
        if cap is not None and s.retry_billed >= cap:
            return Spent(s.budget, standings)
    return None
