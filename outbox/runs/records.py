"""What a run's operations and history say: the budget drawn, the step operations, the history.

Shared by the advance (outbox/runs/advance.py) and what people read (outbox/runs/lifecycle.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from outbox.ledger.models import Attempt, Operation, Run
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import AttemptClass, AttemptKind
from outbox.runs.spec import Step

UNDOING = "; undoing "  # joins why a run compensates and what it undoes, in its reason


@dataclass(frozen=True)
class Usage:
    """What a run's steps drew from its budget: attempts that reached (or may have reached) the
    provider, sends and lookups alike; compensations are not drawn (undoing is never blocked)."""

    dispatches: int
    lookups: int
    retries: int  # dispatch attempts after each step's first: the retry-billed calls

    @property
    def used(self) -> int:
        return self.dispatches + self.lookups


def usage(session: Session, run: Run, steps: Sequence[Step]) -> Usage:
    keys = [s.key(run.run_key) for s in steps]
    per_op = (
        select(
            Attempt.operation_id,
            func.sum(case((Attempt.kind == AttemptKind.DISPATCH.value, 1), else_=0)).label("dispatches"),
            func.sum(case((Attempt.kind == AttemptKind.LOOKUP.value, 1), else_=0)).label("lookups"),
        )
        .join(Operation, Operation.id == Attempt.operation_id)
        .where(
            Operation.tenant == run.tenant,
            Operation.idempotency_key.in_(keys),
            Operation.run_id == run.id,
            Attempt.attempt_class != AttemptClass.NOT_SENT.value,
        )
        .group_by(Attempt.operation_id)
    )
    rows = session.execute(per_op).all()
    dispatches = sum(int(r.dispatches or 0) for r in rows)
    return Usage(
        dispatches=dispatches,
        lookups=sum(int(r.lookups or 0) for r in rows),
        retries=sum(max(int(r.dispatches or 0) - 1, 0) for r in rows),
    )


def step_operations(session: Session, run: Run, steps: Sequence[Step]) -> dict[str, Operation]:
    """The run's operations by idempotency key (steps and compensations that exist so far)."""
    keys = [s.key(run.run_key) for s in steps] + [s.compensation_key(run.run_key) for s in steps if s.compensate]
    stmt = (
        select(Operation)
        # Its own operations only: a plain intent (or another run's step) under one of these keys is
        # never taken for this run's step (the advance refuses to go on instead).
        .where(Operation.tenant == run.tenant, Operation.idempotency_key.in_(keys), Operation.run_id == run.id)
        # Core statements (a cancel, a submit) may have moved them in this very session.
        .execution_options(populate_existing=True)
    )
    return {op.idempotency_key: op for op in session.execute(stmt).scalars()}


def record(run: Run, now: dt.datetime, *, to: RunStatus | None, reason: str, actor: str, **extra: Any) -> None:
    """Append to the run's history and set its reason (and status, if ``to``). ``extra``: facts the
    advance reads back (what a compensation set out to undo, and why)."""
    entry = {
        "at": now.isoformat(),
        "from": run.status,
        "to": (to or RunStatus(run.status)).value,
        "reason": reason,
        "actor": actor,
        **extra,
    }
    run.history = [*(run.history or []), entry]
    run.reason = reason
    run.updated_at = now
    if to is not None:
        run.status = to.value
        if to not in ACTIVE:
            run.finished_at = now
            run.current_op_id = None
            run.holding_step = None


def names(steps: Sequence[Step]) -> str:
    return ", ".join(s.name for s in steps) or "none"


def compensation_plan(run: Run) -> dict[str, Any] | None:
    """The history entry that began the current compensation: ``undo`` (step names, in the order
    they are undone), ``because`` (failed, cancel or budget) and its reason; None if none began."""
    return next((e for e in reversed(run.history or []) if e["to"] == "compensating" != e["from"]), None)
