"""The advance: moves each run along its step table, from what its operations' states prove.

A run holds no progress of its own that its operations do not already prove: each step is an
operation with a derived key (outbox/runs/spec.py), so the advance reads them and decides, every
time, from the first step: a succeeded step is reused from its record, never re-sent; the first
step without an operation is submitted (created now, in this transaction, with what is left of the
run's budget); an unresolved step (in flight, outcome_unknown, awaiting approval, waiting for a
person) holds the run, and only its run. A crash anywhere resumes from the first unresolved step.

When a step ends with no effect (failed_before_commit, cancelled), the completed steps are undone
in reverse order by their compensations, each an operation with its own derived key, so a
compensation also happens at most once; a completed step that cannot be undone (irreversible, or no
compensation declared) sends the run to a person instead, with nothing attempted. Drafts have no
real effect: they are never compensated.

The relay calls ``advance_due`` on every tick (workers/relay/loop.py); each run is advanced in its own
transaction with its row locked (SKIP LOCKED: two relays never advance one run at once), and
creating a step twice is impossible anyway (the key is unique).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import IdempotencyConflict, InvalidIntent, KeySpaceConflict
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.envelope import loads_exact
from outbox.ledger.intent import Intent
from outbox.ledger.models import Operation, Run
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import EFFECT, NO_EFFECT, AttemptClass, Status
from outbox.ledger.submit import submit
from outbox.runs.records import UNDOING, compensation_plan, names, record, step_operations, usage
from outbox.runs.spec import Compensation, Step, steps_from_json

log = logging.getLogger(__name__)

ADVANCE_BATCH = 100
SETTLED = EFFECT | NO_EFFECT


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

    def submit_op(self, key: str, what: Step | Compensation, *, capped: bool) -> Operation | str:
        """Create the operation for a step, or for its compensation (``capped``: drawn from the run's
        budget, as steps are and compensations are not); a string says why it could not."""
        max_attempts: int | None = None
        deadline_s: float | None = None
        if capped and self.run.max_attempts is not None:
            max_attempts = max(self.run.max_attempts - usage(self.session, self.run, self.steps).used, 1)
        if capped and self.run.deadline_at is not None:
            deadline_s = max((as_utc(self.run.deadline_at) - self.now).total_seconds(), 0.001)  # type: ignore[operator]
        if what.args is None:
            return f"{key}: its arguments were purged (OUTBOX_ARGS_RETENTION_S); a person must act"
        try:
            intent = Intent(
                tenant=self.run.tenant,
                idempotency_key=key,
                action=what.action,
                args=loads_exact(what.args),
                subject=self.run.subject,
                submitted_by=self.run.submitted_by,
                key_space="run",
                run_id=self.run.id,
                max_attempts=max_attempts,
                deadline_s=deadline_s,
                requires_approval=what.requires_approval,
                provider_key=what.provider_key,
                priority=self.run.priority,
            )
            receipt = submit(self.session, intent)
        except KeySpaceConflict as exc:
            return f"the derived key {key!r} is already used by a plain intent (operation {exc.operation_id})"
        except IdempotencyConflict as exc:
            return f"the derived key {key!r} is already used by operation {exc.operation_id} with other arguments"
        except InvalidIntent as exc:
            return f"{key}: {exc}"
        op = self.session.get(Operation, receipt.operation_id)
        assert op is not None
        if op.run_id != self.run.id:
            # Two runs' derived keys can meet ("x" + "a:compensate" and "x:a" + "compensate").
            return f"the derived key {key!r} is already used by another run's operation {op.id}"
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
                made = self.submit_op(step.key(self.run.run_key), step, capped=True)
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
                # A step the budget cut short stops the run (nothing more is sent); one the provider
                # refused, or a person cancelled or denied, fails it: its predecessors are undone.
                spent = self.budget_spent() if op.error_class != AttemptClass.REJECTED.value else None
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
        tail = f"; done: {names(done)}; not sent: {names(not_sent)}"
        undo = kind == "failed" or self.run.compensate_requested
        if not real:
            if kind == "cancel":
                return self.end(RunStatus.CANCELLED, f"{why}; nothing of the run was done" + tail)
            return self.end(
                RunStatus.FAILED,
                f"{why}; nothing of the run was done (drafts only: {names(done)})"
                if done
                else f"{why}; nothing of the run was done; not sent: {names(not_sent)}",
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
        plan = [s.name for s in reversed(real)]
        record(
            self.run,
            self.now,
            to=RunStatus.COMPENSATING,
            reason=f"{why}{UNDOING}{names(list(reversed(real)))}",
            actor=self.actor,
            undo=plan,
            because=kind,
        )
        self.run.current_op_id = self.run.holding_step = None
        return self.compensate() or True

    # -- compensation -----------------------------------------------------------------------
    def compensate(self) -> bool:
        """Undo, in the order planned when compensation began, each step it set out to undo. Anything
        else found done meanwhile (a late success, a person's "succeeded") was not planned for: a
        person decides, rather than undo it out of order or leave it unsaid."""
        started = compensation_plan(self.run) or {}
        by_name = {s.name: s for s in self.steps}
        plan = [by_name[n] for n in started.get("undo", []) if n in by_name]
        why = str(started.get("reason", "a step failed")).rsplit(UNDOING, 1)[0]
        surprise = [s for s in self.done() if s.phase != "draft" and s not in plan]
        unsettled = [
            s for s in self.steps if (o := self.op(s)) is not None and o.status == Status.RECONCILIATION_REQUIRED.value
        ]
        if surprise or unsettled:
            return self.end(
                RunStatus.NEEDS_PERSON,
                f"{why}; while its steps were being undone, {names(surprise + unsettled)} turned out done or wait for "
                f"a person (late evidence, or a person's decision): compensation stopped; undone so far: "
                f"{names([s for s in plan if self.undone(s)])}",
            )
        for step in plan:
            comp = step.compensate
            if comp is None or self.cannot_undo(step) == "irreversible":
                return self.end(RunStatus.NEEDS_PERSON, f"{why}; {step.name} cannot be undone (no compensation)")
            op = self.comp_op(step)
            if op is None:
                made = self.submit_op(step.compensation_key(self.run.run_key), comp, capped=False)
                if isinstance(made, str):
                    return self.end(
                        RunStatus.NEEDS_PERSON, f"the compensation of {step.name} cannot be submitted: {made}"
                    )
                return self.hold(step, made, f"compensating {step.name}: {comp.action} submitted")
            status = Status(op.status)
            if status in EFFECT:
                continue
            if status in NO_EFFECT:
                return self.end(
                    RunStatus.NEEDS_PERSON,
                    f"{why}; the compensation of {step.name} ({comp.action}) ended {status.value}: "
                    f"{op.reason or op.last_error or 'no reason'}; undone: {names([s for s in plan if self.undone(s)])}; "
                    f"still done: {names([s for s in plan if not self.undone(s)])}",
                )
            return self.hold(step, op, f"compensating {step.name}: {status.value}")
        if started.get("because") == "cancel":
            return self.end(RunStatus.CANCELLED, f"{why}; completed steps undone in reverse order: {names(plan)}")
        return self.end(RunStatus.COMPENSATED, f"{why}; undone in reverse order: {names(plan)}")

    def undone(self, step: Step) -> bool:
        return (c := self.comp_op(step)) is not None and Status(c.status) in EFFECT


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
    return list(session.execute(_due_runs_statement(limit)).scalars())


@functools.lru_cache(maxsize=8)
def _due_runs_statement(limit: int) -> Any:
    """Built once: the relay asks every tick, runs or none."""
    current = Operation.__table__.alias("current")
    return (
        select(Run.id)
        .outerjoin(current, current.c.id == Run.current_op_id)
        .where(
            Run.status.in_([s.value for s in ACTIVE]),
            or_(Run.current_op_id.is_(None), current.c.status.in_([s.value for s in SETTLED])),
        )
        .order_by(Run.updated_at)
        .limit(limit)
    )


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
        try:
            with sessions.begin() as session:
                stmt = select(Run).where(Run.id == run_id).with_for_update(skip_locked=True)
                run = session.execute(stmt).scalar_one_or_none()
                if run is not None and advance(session, run, actor=actor, irreversible=irreversible):
                    moved += 1
        except OperationalError:
            raise  # the database is away: the caller's loop waits and retries
        except Exception:  # noqa: BLE001 - one run that cannot advance must not stop the others, nor the relay
            log.warning("run %s could not advance; it stays as it is, tried again next tick", run_id, exc_info=True)
    return moved
