"""The fair claim's ranking on SQLite: which due rows a claim takes, in the PostgreSQL statement's
order (outbox/ledger/drivers/sql/claim.sql), with window functions over every due row. The
embedded default is one machine's ledger; its backlog is small enough to rank whole."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, false, func, literal, select
from sqlalchemy.orm import Session

from outbox.ledger.clock import db_now
from outbox.ledger.fairness import Fairness
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import Status

_OP = core_table(Operation)


def fair_order(session: Session, wanted: list[str], take: int, fairness: Fairness) -> list[str]:
    """The ids a fair claim takes, in rank order (the PostgreSQL statement's order): each due row
    gets its turn within its tenant (wanted ids first, then priority, then age), and the claim
    takes turns over weights, ties in tenant order after the cursor. One writer at a time, so
    reading first and claiming next sees the same rows."""
    given = _OP.c.id.in_(wanted) if wanted else false()
    turn = func.row_number().over(
        partition_by=_OP.c.tenant,
        order_by=(case((given, 0), else_=1), _OP.c.priority.desc(), _OP.c.next_attempt_at),
    )
    due = (
        select(_OP.c.id, _OP.c.tenant, turn.label("turn"))
        .where(_OP.c.status == Status.NOT_DISPATCHED.value, _OP.c.next_attempt_at <= db_now())
        .subquery()
    )
    weight: Any = (
        case({t: w for t, w in fairness.weights.items()}, value=due.c.tenant, else_=literal(1.0))
        if fairness.weights
        else literal(1.0)
    )
    after = fairness.after
    ranked = select(due.c.id).order_by(due.c.turn * 1.0 / weight, due.c.tenant <= after, due.c.tenant).limit(take)
    return list(session.execute(ranked).scalars())
