"""Budgets per conversation: what an agent's own tool calls may spend, charged atomically at submit.

A run declared up front shares one budget (outbox/runs/); an agent's dynamic tool calls carry a
*budget scope* instead: the host's conversation, run or thread id (MCP's scope, the Agents SDK's run
context, LangGraph's thread id, the HTTP API's ``Outbox-Budget-Scope`` header). The actions file says
what one scope may spend (``budget_scope:`` at the top, for every tool call of a conversation, and per
action, for that action's calls):

- ``max_calls``: new operations (a replay of the same call is the same operation and costs nothing);
- ``max_amount: {arg, limit, currency, decimals}``: the sum of the action's amount argument;
- ``max_retry_billed``: attempts beyond each call's first, summed over the scope's operations:
  each is charged right before it leaves, and none leaves once they are spent
  (outbox/ledger/budget_charges.py); a new call is refused once the conversation has spent them;
- ``deadline_s``: from the scope's first call; later calls are refused.

**Atomic under concurrency.** Each (tenant, scope, bucket) is one row, charged by ONE conditional
upsert: ``INSERT ... ON CONFLICT DO UPDATE SET calls = calls + 1, ... WHERE calls + 1 <= max AND
amount + this <= limit AND opened_at > now - deadline RETURNING``. PostgreSQL evaluates the WHERE
against the row as the previous charge committed it (the conflicting row is locked), SQLite has one
writer: two parallel calls on the last unit cannot both pass. The charge is made in the submit's
transaction, after the intent's row, inside a savepoint: a refusal stores nothing, and a caller that
rolls back gets its unit back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from outbox.errors import BudgetExhausted, InvalidIntent
from outbox.ledger.clock import db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import core_table
from outbox.ledger.scope_models import ScopeSpend

_SPEND = core_table(ScopeSpend)
EVERY_TOOL = "*"  # the bucket of the top-level budget_scope: every action's calls in the scope
MICROS = Decimal(1_000_000)
MAX_SCOPE = 255


@dataclass(frozen=True)
class AmountCap:
    """A money cap summed over an action's amount argument (``limit`` in the argument's own unit;
    ``decimals``: how many of its digits are a fraction of ``currency``, 2 for ``amount_cents``)."""

    arg: str
    limit: Decimal
    currency: str | None = None
    decimals: int = 0

    def shown(self, units: Decimal) -> str:
        value = units.scaleb(-self.decimals) if self.decimals else units
        text = f"{value:.{self.decimals}f}" if self.decimals else f"{value.normalize():f}"
        return f"{text} {self.currency}" if self.currency else text


@dataclass(frozen=True)
class ScopeLimit:
    """What one budget of a scope may spend, as the actions file declares it (``budget_scope:``):
    ``bucket`` is the action's name, or ``*`` for every tool call. What was spent is a ScopeSpend row."""

    bucket: str
    max_calls: int | None = None
    max_amount: AmountCap | None = None
    max_retry_billed: int | None = None
    deadline_s: float | None = None

    @property
    def where(self) -> str:
        return "this conversation" if self.bucket == EVERY_TOOL else f"this conversation's {self.bucket} calls"


@dataclass(frozen=True)
class Standing:
    """What a scope has spent of one budget, and what is left."""

    budget: ScopeLimit
    calls: int
    amount: Decimal  # in the amount argument's unit
    retry_billed: int
    opened_at: datetime | None

    def left(self) -> str:
        """'3 of 20 calls, 120.00 of 500.00 EUR left in this conversation'."""
        b, parts = self.budget, []
        if b.max_calls is not None:
            parts.append(f"{max(b.max_calls - self.calls, 0)} of {b.max_calls} calls")
        if b.max_amount is not None:
            cap = b.max_amount
            parts.append(f"{cap.shown(max(cap.limit - self.amount, Decimal(0)))} of {cap.shown(cap.limit)}")
        if b.max_retry_billed is not None:
            parts.append(f"{max(b.max_retry_billed - self.retry_billed, 0)} of {b.max_retry_billed} retries")
        text = ", ".join(parts) + f" left in {b.where}" if parts else ""
        if b.deadline_s is not None:
            text += ("; " if text else "") + f"the budget lasts {b.deadline_s:g}s from the conversation's first call"
        return text

    def as_dict(self) -> dict[str, Any]:
        b = self.budget
        out: dict[str, Any] = {"bucket": b.bucket, "calls": self.calls}
        if b.max_calls is not None:
            out["max_calls"] = b.max_calls
        if b.max_amount is not None:
            out |= {
                "amount": str(self.amount),
                "max_amount": str(b.max_amount.limit),
                "amount_arg": b.max_amount.arg,
                "currency": b.max_amount.currency,
            }
        if b.max_retry_billed is not None:
            out |= {"retry_billed": self.retry_billed, "max_retry_billed": b.max_retry_billed}
        if b.deadline_s is not None:
            out["deadline_s"] = b.deadline_s
            out["opened_at"] = self.opened_at.isoformat() if self.opened_at else None
        return out


def describe(standings: Sequence[Standing]) -> str:
    """Every budget's 'left' sentence, one after the other."""
    return "; ".join(s.left() for s in standings if s.left())


def validate_scope(scope: Any) -> str:
    if not isinstance(scope, str) or not scope.strip() or len(scope) > MAX_SCOPE or "\x00" in scope:
        raise InvalidIntent(
            "budget_scope", f"must be the host's conversation, run or thread id (1-{MAX_SCOPE} characters)"
        )
    return scope


def amount_of(cap: AmountCap, args: Mapping[str, Any]) -> Decimal:
    """The call's amount (its argument's value), exact; InvalidIntent naming the argument otherwise."""
    raw = args.get(cap.arg)
    field = f"args.{cap.arg}"
    if raw is None or isinstance(raw, bool):
        raise InvalidIntent(field, "required: the conversation's money cap (budget_scope.max_amount) sums it")
    try:
        value = raw if isinstance(raw, Decimal) else Decimal(str(raw)) if isinstance(raw, (int, str)) else None
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value < 0 or value.adjusted() > 15:
        raise InvalidIntent(field, "must be a non-negative number (the amount the money cap sums)")
    if (value * MICROS) != (value * MICROS).to_integral_value():
        raise InvalidIntent(field, "at most 6 decimal places (the money cap sums it exactly)")
    return value


def _micros(value: Decimal) -> int:
    return int(value * MICROS)


def standing(session: Session, *, tenant: str, scope: str, budgets: Sequence[ScopeLimit]) -> list[Standing]:
    """What the scope has spent of each budget (nothing charged)."""
    if not budgets:
        return []
    rows = {
        r.bucket: r
        for r in session.execute(
            select(
                _SPEND.c.bucket, _SPEND.c.calls, _SPEND.c.amount_micros, _SPEND.c.retry_billed, _SPEND.c.opened_at
            ).where(
                _SPEND.c.tenant == tenant, _SPEND.c.scope == scope, _SPEND.c.bucket.in_([b.bucket for b in budgets])
            )
        )
    }
    out = []
    for b in budgets:
        row = rows.get(b.bucket)
        if row is None:
            out.append(Standing(b, 0, Decimal(0), 0, None))
        else:
            amount = Decimal(row.amount_micros) / MICROS
            out.append(Standing(b, row.calls, amount, int(row.retry_billed or 0), row.opened_at))
    return out


class NoRoom(Exception):
    """A budget had no room for the call (raised inside the submit's savepoint; ``refusal`` turns it
    into the caller's BudgetExhausted once the savepoint is rolled back)."""

    def __init__(self, budget: ScopeLimit, why: str) -> None:
        super().__init__(why)
        self.budget, self.why = budget, why


def charge(
    session: Session, *, tenant: str, scope: str, budgets: Sequence[ScopeLimit], args: Mapping[str, Any]
) -> list[Standing]:
    """Charge one new call to each budget, or raise NoRoom (the caller rolls the savepoint back and
    raises ``refusal``: submit.py). Returns what is left after the charge."""
    out = []
    for b in budgets:
        amount = amount_of(b.max_amount, args) if b.max_amount is not None else Decimal(0)
        if b.max_retry_billed == 0:  # no retry at all: the upsert's insert path would check nothing
            raise NoRoom(b, "its 0 retries are spent")
        if b.max_amount is not None and amount > b.max_amount.limit:
            cap = b.max_amount
            raise NoRoom(b, f"this call's {cap.shown(amount)} exceeds the cap of {cap.shown(cap.limit)}")
        row = session.execute(_upsert(session, tenant, scope, b, _micros(amount))).first()
        if row is None:
            raise NoRoom(b, _why_full(session, tenant, scope, b, amount))
        out.append(Standing(b, row.calls, Decimal(row.amount_micros) / MICROS, row.retry_billed, row.opened_at))
    return out


def _upsert(session: Session, tenant: str, scope: str, b: ScopeLimit, micros: int) -> Any:
    room = []
    if b.max_calls is not None:
        room.append(_SPEND.c.calls + 1 <= b.max_calls)
    if b.max_amount is not None:
        room.append(_SPEND.c.amount_micros + micros <= _micros(b.max_amount.limit))
    if b.max_retry_billed is not None:  # the retries charged so far (outbox/ledger/budget_charges.py)
        room.append(_SPEND.c.retry_billed < b.max_retry_billed)
    if b.deadline_s is not None:
        room.append(_SPEND.c.opened_at > db_now(-b.deadline_s))
    return (
        driver_for(session)
        .upsert(_SPEND)
        .values(
            tenant=tenant,
            scope=scope,
            bucket=b.bucket,
            calls=1,
            amount_micros=micros,
            opened_at=db_now(),
            updated_at=db_now(),
        )
        .on_conflict_do_update(
            index_elements=[_SPEND.c.tenant, _SPEND.c.scope, _SPEND.c.bucket],
            set_={
                "calls": _SPEND.c.calls + 1,
                "amount_micros": _SPEND.c.amount_micros + micros,
                "updated_at": db_now(),
            },
            where=and_(*room) if room else None,
        )
        .returning(_SPEND.c.calls, _SPEND.c.amount_micros, _SPEND.c.retry_billed, _SPEND.c.opened_at)
    )


def _why_full(session: Session, tenant: str, scope: str, b: ScopeLimit, amount: Decimal) -> str:
    (now_spent,) = standing(session, tenant=tenant, scope=scope, budgets=[b])
    if b.max_calls is not None and now_spent.calls + 1 > b.max_calls:
        return f"its {b.max_calls} calls are used"
    if b.max_retry_billed is not None and now_spent.retry_billed >= b.max_retry_billed:
        return f"its {b.max_retry_billed} retries are spent"
    if b.max_amount is not None and now_spent.amount + amount > b.max_amount.limit:
        cap = b.max_amount
        return (
            f"{cap.shown(now_spent.amount)} of {cap.shown(cap.limit)} is spent and this call asks {cap.shown(amount)}"
        )
    return f"its {b.deadline_s:g}s since the first call are over"


def refusal(
    session: Session, *, tenant: str, scope: str, budgets: Sequence[ScopeLimit], no_room: NoRoom
) -> BudgetExhausted:
    """What the caller hears (read after the savepoint's rollback: what is left without this call)."""
    left = standing(session, tenant=tenant, scope=scope, budgets=budgets)
    message = (
        f"Refused: the budget of {no_room.budget.where} has no room for this call ({no_room.why}); nothing was "
        "submitted or sent. "
        f"Left: {describe(left) or 'nothing'}. Do not retry this call in this conversation; tell the user, "
        "or ask a person to raise the budget."
    )
    return BudgetExhausted(message, scope=scope, left={"budgets": [s.as_dict() for s in left]})
