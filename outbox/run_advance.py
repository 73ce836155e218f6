"""The advance: moves each run along its step table, from what its operations' states prove.

A run holds no progress of its own that its operations do not already prove: each step is an
operation with a derived key (outbox/run_spec.py), so the advance reads them and decides, every
time, from the first step: a succeeded step is reused from its record, never re-sent; the first
step without an operation is submitted (created now, in this transaction, with what is left of the
run's budget); an unresolved step (in flight, outcome_unknown, awaiting approval, waiting for a
person) holds the run, and only its run. A crash anywhere resumes from the first unresolved step.

When a step ends with no effect (failed_before_commit, cancelled), the completed steps are undone
in reverse order by their compensations, each an operation with its own derived key, so a
compensation also happens at most once; a completed step that cannot be undone (irreversible, or no
compensation declared) sends the run to a person instead, with nothing attempted. Drafts have no
real effect: they are never compensated.

The relay calls ``advance_due`` on every tick (workers/relay.py); each run is advanced in its own
transaction with its row locked (SKIP LOCKED: two relays never advance one run at once), and
creating a step twice is impossible anyway (the key is unique).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.clock import as_utc, db_now
from outbox.envelope import loads_exact
from outbox.errors import IdempotencyConflict, InvalidIntent
from outbox.models import Attempt, Operation, Run
from outbox.run_spec import Step, steps_from_json
from outbox.run_states import ACTIVE, RunStatus
from outbox.states import EFFECT, NO_EFFECT, AttemptClass, AttemptKind, Status
from outbox.submit import submit

log = logging.getLogger(__name__)

ADVANCE_BATCH = 100
SETTLED = EFFECT | NO_EFFECT
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
        .where(Operation.tenant == run.tenant, Operation.idempotency_key.in_(keys))
        # Core statements (a cancel, a submit) may have moved them in this very session.
        .execution_options(populate_existing=True)
    )
    return {op.idempotency_key: op for op in session.execute(stmt).scalars()}


def record(run: Run, now: dt.datetime, *, to: RunStatus | None, reason: str, actor: str) -> None:
    """Append to the run's history and set its reason (and status, if ``to``)."""
    entry = {
        "at": now.isoformat(),
        "from": run.status,
        "to": (to or RunStatus(run.status)).value,
        "reason": reason,
        "actor": actor,
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


def _names(steps: Sequence[Step]) -> str:
    return ", ".join(s.name for s in steps) or "none"


class _Advance:
    """One run's advance, inside its transaction (the run row locked)."""

    def __init__(self, session: Session, run: Run, *, actor: str, irreversible: frozenset[str]) -> None:
        self.session, self.run, self.actor = session, run, actor
        self.steps = steps_from_json(run.steps or "[]")
        self.ops = step_operations(session, run, self.steps)
        now = as_utc(session.execute(select(db_now())).scalar_one())
        assert now is not None
        self.now: dt.datetime = now
        self.irreversible = irreversible

    # -- what the operations prove ----------------------------------------------------------
    def op(self, step: Step) -> Operation | None:
        return self.ops.get(step.key(self.run.run_key))

    def comp_op(self, step: Step) -> Operation | None:
        return self.ops.get(step.compensation_key(self.run.run_key))

    def done(self) -> list[Step]:
        return [s for s in self.steps if (op := self.op(s)) is not None and Status(op.status) in EFFECT]

    def not_sent(self) -> list[Step]:
        return [s for s in self.steps if self.op(s) is None]

    def cannot_undo(self, step: Step) -> str | None:
        if step.irreversible or step.action in self.irreversible:
            return "irreversible"
        if step.compensate is None:
            return "no compensation declared"
        return None

    # -- moves ------------------------------------------------------------------------------
    def hold(self, step: Step, op: Operation, why: str) -> bool:
        if self.run.current_op_id == op.id:
            return False
        self.run.current_op_id, self.run.holding_step = op.id, step.name
        record(self.run, self.now, to=None, reason=why, actor=self.actor)
        return True

    def end(self, to: RunStatus, reason: str) -> bool:
        record(self.run, self.now, to=to, reason=reason, actor=self.actor)
        log.log(
            logging.WARNING if to is RunStatus.NEEDS_PERSON else logging.INFO,
            "run %s: %s (%s)",
            self.run.id,
            to.value,
            reason,
        )
        return True

    def submit_op(
        self,
        step: Step,
        *,
        key: str,
        action: str,
        args: str | None,
        provider_key: str | None,
        approval: bool,
        capped: bool,
    ) -> Operation | str:
        """Create the operation for a step (or its compensation); a string says why it could not."""
        max_attempts: int | None = None
        deadline_s: float | None = None
        if capped and self.run.max_attempts is not None:
            max_attempts = max(self.run.max_attempts - usage(self.session, self.run, self.steps).used, 1)
        if capped and self.run.deadline_at is not None:
            deadline_s = max((as_utc(self.run.deadline_at) - self.now).total_seconds(), 0.001)  # type: ignore[operator]
        if args is None:
            return f"{key}: its arguments were purged (OUTBOX_ARGS_RETENTION_S); a person must act"
        try:
            receipt = submit(
                self.session,
                tenant=self.run.tenant,
                idempotency_key=key,
                action=action,
                args=loads_exact(args),
                subject=self.run.subject,
                run_id=self.run.id,
                max_attempts=max_attempts,
                deadline_s=deadline_s,
                requires_approval=approval,
                provider_key=provider_key,
            )
        except IdempotencyConflict as exc:
            return f"the derived key {key!r} is already used by operation {exc.operation_id} with other arguments"
        except InvalidIntent as exc:
            return f"{key}: {exc}"
        op = self.session.get(Operation, receipt.operation_id)
        assert op is not None
        self.ops[key] = op
        return op

    # -- the forward pass -------------------------------------------------------------------
    def budget_spent(self) -> str | None:
        run = self.run
        if run.deadline_at is not None and self.now >= as_utc(run.deadline_at):  # type: ignore[operator]
            return f"the run's deadline passed ({as_utc(run.deadline_at).isoformat()})"  # type: ignore[union-attr]
        if run.max_attempts is not None:
            spent = usage(self.session, run, self.steps)
            if spent.used >= run.max_attempts:
                return f"the run's budget of {run.max_attempts} attempts is spent ({spent.used} used, {spent.retries} retries)"
        return None

    def forward(self) -> bool:
        n = len(self.steps)
        for i, step in enumerate(self.steps):
            op = self.op(step)
            if op is None:
                if self.run.cancel_requested:
                    return self.stop(step, "cancel", "the run was cancelled")
                spent = self.budget_spent()
                if spent:
                    return self.stop(step, "budget", spent)
                made = self.submit_op(
                    step,
                    key=step.key(self.run.run_key),
                    action=step.action,
                    args=step.args,
                    provider_key=step.provider_key,
                    approval=step.requires_approval,
                    capped=True,
                )
                if isinstance(made, str):
                    return self.end(RunStatus.NEEDS_PERSON, f"step {step.name} cannot be submitted: {made}")
                return self.hold(step, made, f"step {i + 1} of {n} submitted: {step.name} ({step.action})")
            status = Status(op.status)
            if status in EFFECT:
                continue
            if status in NO_EFFECT:
                why = f"step {step.name} ({step.action}) ended {status.value}: {op.reason or op.last_error or 'no reason'}"
                if self.run.cancel_requested:
                    return self.stop(step, "cancel", f"the run was cancelled; {why}")
                spent = self.budget_spent()
                if spent:
                    return self.stop(step, "budget", f"{why}; {spent}")
                return self.stop(step, "failed", why)
            return self.hold(
                step, op, f"step {i + 1} of {n} ({step.name}) is {status.value}: {op.reason or ''}".rstrip(": ")
            )
        return self.end(RunStatus.SUCCEEDED, f"all {n} steps succeeded")

    def stop(self, at: Step, kind: str, why: str) -> bool:
        """The forward pass ends at ``at``: cancelled by request, budget spent, or a step failed."""
        done, not_sent = self.done(), self.not_sent()
        real = [s for s in done if s.phase != "draft"]
        tail = f"; done: {_names(done)}; not sent: {_names(not_sent)}"
        undo = kind == "failed" or self.run.compensate_requested
        if not real:
            if kind == "cancel":
                return self.end(RunStatus.CANCELLED, f"{why}; nothing of the run was done" + tail)
            return self.end(
                RunStatus.FAILED,
                f"{why}; nothing of the run was done (drafts only: {_names(done)})"
                if done
                else f"{why}; nothing of the run was done; not sent: {_names(not_sent)}",
            )
        if not undo:
            if kind == "cancel":
                return self.end(RunStatus.CANCELLED, f"{why}; completed steps kept (not compensated)" + tail)
            return self.end(
                RunStatus.NEEDS_PERSON,
                f"{why}; completed steps remain: undo them with `agent-outbox runs cancel {self.run.id} --compensate`, "
                f"or close the run with `runs resolve`" + tail,
            )
        blocked = [(s, r) for s in real if (r := self.cannot_undo(s))]
        if blocked:
            which = ", ".join(f"{s.name} ({r})" for s, r in blocked)
            return self.end(
                RunStatus.NEEDS_PERSON,
                f"{why}; completed step(s) that cannot be undone: {which}: no compensation was attempted" + tail,
            )
        record(
            self.run,
            self.now,
            to=RunStatus.COMPENSATING,
            reason=f"{why}{UNDOING}{_names(list(reversed(real)))}",
            actor=self.actor,
        )
        self.run.current_op_id = self.run.holding_step = None
        return self.compensate() or True

    # -- compensation -----------------------------------------------------------------------
    def compensate(self) -> bool:
        real = [s for s in self.done() if s.phase != "draft"]
        for step in reversed(real):
            comp = step.compensate
            assert comp is not None  # checked before compensating began
            op = self.comp_op(step)
            if op is None:
                made = self.submit_op(
                    step,
                    key=step.compensation_key(self.run.run_key),
                    action=comp.action,
                    args=comp.args,
                    provider_key=comp.provider_key,
                    approval=comp.requires_approval,
                    capped=False,
                )
                if isinstance(made, str):
                    return self.end(
                        RunStatus.NEEDS_PERSON, f"the compensation of {step.name} cannot be submitted: {made}"
                    )
                return self.hold(step, made, f"compensating {step.name}: {comp.action} submitted")
            status = Status(op.status)
            if status in EFFECT:
                continue
            if status in NO_EFFECT:
                undone = [s.name for s in real if (c := self.comp_op(s)) is not None and Status(c.status) in EFFECT]
                return self.end(
                    RunStatus.NEEDS_PERSON,
                    f"the compensation of {step.name} ({comp.action}) ended {status.value}: "
                    f"{op.reason or op.last_error or 'no reason'}; undone: {', '.join(undone) or 'none'}; "
                    f"still done: {_names([s for s in real if s.name not in undone])}",
                )
            return self.hold(step, op, f"compensating {step.name}: {status.value}")
        names = _names(list(reversed(real)))
        if self.run.cancel_requested:
            return self.end(RunStatus.CANCELLED, f"cancelled; completed steps undone in reverse order: {names}")
        started = next(
            (e["reason"] for e in reversed(self.run.history or []) if e["to"] == "compensating" != e["from"]), ""
        )
        why = started.rsplit(UNDOING, 1)[0] or "a step failed"
        return self.end(RunStatus.COMPENSATED, f"{why}; undone in reverse order: {names}")


def advance(session: Session, run: Run, *, actor: str = "advance", irreversible: frozenset[str] = frozenset()) -> bool:
    """Move one run as far as its operations allow now; True if anything changed. ``irreversible``:
    actions the actions file marks irreversible now (added to what the run recorded at submit)."""
    if RunStatus(run.status) not in ACTIVE:
        return False
    step = _Advance(session, run, actor=actor, irreversible=irreversible)
    if run.status == RunStatus.COMPENSATING.value:
        return step.compensate()
    return step.forward()


def due_run_ids(session: Session, *, limit: int = ADVANCE_BATCH) -> list[str]:
    """Moving runs whose advance can do something: no current operation, or it has settled."""
    current = Operation.__table__.alias("current")
    stmt = (
        select(Run.id)
        .outerjoin(current, current.c.id == Run.current_op_id)
        .where(
            Run.status.in_([s.value for s in ACTIVE]),
            or_(Run.current_op_id.is_(None), current.c.status.in_([s.value for s in SETTLED])),
        )
        .order_by(Run.updated_at)
        .limit(limit)
    )
    return list(session.execute(stmt).scalars())


def advance_due(
    sessions: sessionmaker[Session],
    *,
    actor: str = "relay",
    irreversible: frozenset[str] = frozenset(),
    limit: int = ADVANCE_BATCH,
) -> int:
    """Advance every run that can move (each in its own transaction, its row locked); returns how
    many moved."""
    with sessions() as session:
        ids = due_run_ids(session, limit=limit)
    moved = 0
    for run_id in ids:
        with sessions.begin() as session:
            run = session.execute(
                select(Run).where(Run.id == run_id).with_for_update(skip_locked=True)
            ).scalar_one_or_none()
            if run is not None and advance(session, run, actor=actor, irreversible=irreversible):
                moved += 1
    return moved
