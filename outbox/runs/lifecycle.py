"""Runs: a named, ordered list of steps submitted in one transaction (DESIGN.md, "Runs").

``submit_run`` writes the run and its first step's operation in the caller's transaction (it never
commits, as ``submit``); later steps become operations when the one before has succeeded
(outbox/runs/advance.py). Resubmitting the same run (same tenant, run key and digest) returns it; a
changed step or budget is a ``RunConflict``.

``cancel_run`` stops future steps (a step in flight keeps its late result: recorded, never dropped)
and, with ``compensate``, undoes completed steps; ``resolve_run`` closes a run a person took over.
``run_json`` is what every surface shows: the steps with their states, which step holds the run and
why, the budget used, and the typed outcome for a model.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent, KeySpaceConflict, RunConflict, RunNotFound, RunNotMovable
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.drivers import driver_for
from outbox.ledger.intent import validate_priority
from outbox.ledger.models import Operation, Run
from outbox.ledger.run_states import ACTIVE, RUN_MEANING, RunStatus
from outbox.ledger.states import Status
from outbox.ledger.stops import refuse_if_stopped
from outbox.ledger.transitions import request_cancel
from outbox.ledger.typed_outcome import Outcome, outcome_of
from outbox.runs.advance import advance
from outbox.runs.records import record, step_operations, usage
from outbox.runs.spec import RunSpec, StepRules, build_run_spec, steps_from_json


@dataclass(frozen=True)
class RunReceipt:
    run_id: str
    tenant: str
    run_key: str
    status: str
    new: bool
    spec_digest: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "tenant": self.tenant,
            "run_key": self.run_key,
            "status": self.status,
            "new": self.new,
            "spec_digest": self.spec_digest,
        }


def submit_run(
    session: Session,
    *,
    tenant: str,
    run_key: str,
    steps: list[dict[str, Any]],
    subject: str,
    budget: dict[str, Any] | None = None,
    rules: StepRules | None = None,
    submitted_by: str | None = None,
    priority: int = 0,
) -> RunReceipt:
    """Write a run and its first step in the caller's transaction (never commits).

    ``steps``: ``[{name, action, args, compensate?: {action, args}}]``, run in this order; each
    step's idempotency key is ``{run_key}:{name}``. ``budget``: ``{max_attempts, deadline_s}`` that
    all steps draw from. ``rules``: the actions file as a producer reads it
    (outbox.actions.rules), for provider keys, approvals, ``phase`` and ``irreversible``.
    ``submitted_by``: the submitting identity (``key:<id>``), carried by every step's operation.
    ``priority`` (-100..100, default 0): every step's and compensation's operation carries it (see
    outbox/ledger/submit.py); stored, not part of the run's digest, as for an intent.
    """
    priority = validate_priority(priority)
    spec = build_run_spec(tenant=tenant, run_key=run_key, steps=steps, subject=subject, budget=budget, rules=rules)
    now = as_utc(session.execute(select(db_now())).scalar_one())
    assert now is not None
    run_id = str(uuid.uuid4())
    deadline = None if spec.budget.deadline_s is None else now + dt.timedelta(seconds=spec.budget.deadline_s)
    values = {
        "id": run_id,
        "tenant": spec.tenant,
        "run_key": spec.run_key,
        "subject": spec.subject,
        "submitted_by": submitted_by,
        "status": RunStatus.RUNNING.value,
        "steps": spec.steps_json(),
        "spec_digest": spec.digest,
        "max_attempts": spec.budget.max_attempts,
        "deadline_at": deadline,
        "priority": priority,
        "cancel_requested": False,
        "compensate_requested": False,
        "history": [
            {
                "at": now.isoformat(),
                "from": None,
                "to": "running",
                "reason": f"submitted: {len(spec.steps)} steps",
                "actor": spec.subject,
            }
        ],
        "reason": f"submitted: {len(spec.steps)} steps",
        "created_at": now,
        "updated_at": now,
    }
    if driver_for(session).insert_run(session, values):
        _refuse_plain_keys(session, spec)
        refuse_if_stopped(session, tenant=spec.tenant, subject=spec.subject, replay=lambda: False)  # rolled back
        run = session.get(Run, run_id)
        assert run is not None
        advance(session, run, actor=spec.subject)  # the first step: due at once, in this transaction
        return RunReceipt(run_id, spec.tenant, spec.run_key, run.status, True, spec.digest)
    existing = session.execute(select(Run).where(Run.tenant == spec.tenant, Run.run_key == spec.run_key)).scalar_one()
    if existing.spec_digest != spec.digest:
        raise RunConflict(spec.run_key, existing.id)
    return RunReceipt(existing.id, existing.tenant, existing.run_key, existing.status, False, existing.spec_digest)


def _refuse_plain_keys(session: Session, spec: RunSpec) -> None:
    """A new run whose derived keys a plain intent already holds is refused (the caller's transaction
    rolls the run back): a plain intent never becomes a run's step. Later steps' keys taken by a plain
    intent after the run was accepted hold the run for a person instead (outbox/runs/advance.py)."""
    keys = [s.key(spec.run_key) for s in spec.steps] + [
        s.compensation_key(spec.run_key) for s in spec.steps if s.compensate
    ]
    taken = session.execute(
        select(Operation.id, Operation.idempotency_key)
        .where(Operation.tenant == spec.tenant, Operation.idempotency_key.in_(keys), Operation.key_space == "intent")
        .limit(1)
    ).first()
    if taken is not None:
        raise KeySpaceConflict(taken.idempotency_key, taken.id, owner="a plain intent")


def find_run(session: Session, id_or_key: str, *, tenant: str | None = None) -> Run:
    """By run id, or by run key (within ``tenant`` if given; must be unambiguous)."""
    run = session.get(Run, id_or_key)
    if run is not None and (tenant is None or run.tenant == tenant):
        return run
    stmt = select(Run).where(Run.run_key == id_or_key)
    if tenant is not None:
        stmt = stmt.where(Run.tenant == tenant)
    rows = list(session.execute(stmt.limit(2)).scalars())
    if not rows:
        raise RunNotFound(f"no run with id or run key {id_or_key!r}")
    if len(rows) > 1:
        raise RunNotFound(f"run key {id_or_key!r} exists in several tenants; pass --tenant")
    return rows[0]


def list_runs(session: Session, *, status: str | None = None, tenant: str | None = None, limit: int = 100) -> list[Run]:
    stmt = select(Run)
    if status is not None:
        if status not in {s.value for s in RunStatus}:
            raise InvalidIntent(
                "status", f"unknown run status {status!r}; one of: " + ", ".join(s.value for s in RunStatus)
            )
        stmt = stmt.where(Run.status == status)
    if tenant is not None:
        stmt = stmt.where(Run.tenant == tenant)
    return list(session.execute(stmt.order_by(Run.created_at.desc(), Run.id).limit(limit)).scalars())


def _locked(session: Session, run: Run) -> Run:
    """The run re-read under its row lock: an advance in progress (the relay's) finishes first, and
    what this request writes is decided on the run as that advance left it."""
    stmt = select(Run).where(Run.id == run.id).with_for_update().execution_options(populate_existing=True)
    return session.execute(stmt).scalar_one()


def cancel_run(
    session: Session,
    run: Run,
    *,
    actor: str,
    compensate: bool = False,
    reason: str = "cancel requested",
    irreversible: frozenset[str] = frozenset(),
) -> Run:
    """Stop the run's future steps; the step in flight is asked to cancel (it keeps a late result).
    ``compensate``: also undo completed steps, in reverse order. A finished run can still be asked
    to compensate when it ended with effects kept (cancelled, or waiting for a person)."""
    run = _locked(session, run)
    status = RunStatus(run.status)
    kept = status in (RunStatus.CANCELLED, RunStatus.NEEDS_PERSON)
    if status not in ACTIVE and not (compensate and kept):
        raise RunNotMovable(
            "run", f"run {run.id} is {status.value}: nothing to cancel" + (" or compensate" if compensate else "")
        )
    now = as_utc(session.execute(select(db_now())).scalar_one())
    assert now is not None
    run.cancel_requested = True
    run.compensate_requested = run.compensate_requested or compensate
    why = f"{reason} by {actor}" + (" (with compensation)" if compensate else "")
    if status not in ACTIVE:  # reopened to undo what it kept
        record(run, now, to=RunStatus.RUNNING, reason=why, actor=actor)
        run.finished_at = None
    else:
        record(run, now, to=None, reason=why, actor=actor)
    if run.current_op_id and status is RunStatus.RUNNING:
        op = session.get(Operation, run.current_op_id)
        if op is not None and Status(op.status) not in (Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED):
            request_cancel(session, op.id, actor=actor, reason=f"run {run.id}: {why}")
    advance(session, run, actor=actor, irreversible=irreversible)
    return run


def resolve_run(session: Session, run: Run, *, actor: str, note: str) -> Run:
    """A person closes a run that waits for one, saying what they did: a run in needs_person, or one
    held by a step or compensation in reconciliation_required, or abandoned (its handoff closed by a
    person without knowing: that holds the run for good)."""
    run = _locked(session, run)
    holder = session.get(Operation, run.current_op_id) if run.current_op_id else None
    held = (
        RunStatus(run.status) in ACTIVE
        and holder is not None
        and holder.status in (Status.RECONCILIATION_REQUIRED.value, Status.ABANDONED.value)
    )
    if run.status != RunStatus.NEEDS_PERSON.value and not held:
        raise RunNotMovable(
            "run",
            f"run {run.id} is {run.status}: a person resolves a run in needs_person, or one held by a step "
            "in reconciliation_required or abandoned",
        )
    if not note or not note.strip():
        raise InvalidIntent("note", "required: what was done about the effects that remained")
    now = as_utc(session.execute(select(db_now())).scalar_one())
    assert now is not None
    run.resolved_by, run.note = actor, note
    record(run, now, to=RunStatus.RESOLVED, reason=f"resolved by {actor}: {note}", actor=actor)
    return run


def flag_contradiction(session: Session, op: Operation, *, reason: str, actor: str) -> None:
    """A step or compensation that had said "no effect" was contradicted by the provider's late
    confirmation (outbox/evidence/late_successes.py): whatever its run says now rests on that, so the run goes
    to a person, also when it had ended (failed, compensated, cancelled, resolved)."""
    if not op.run_id:
        return
    stmt = select(Run).where(Run.id == op.run_id, Run.tenant == op.tenant).with_for_update()
    run = session.execute(stmt).scalar_one_or_none()
    if run is None:
        return  # an intent's free-form run_id, not a run of this ledger
    now = as_utc(session.execute(select(db_now())).scalar_one())
    assert now is not None
    run.finished_at = None
    record(
        run,
        now,
        to=RunStatus.NEEDS_PERSON,
        reason=f"{op.idempotency_key} was contradicted by the provider after the run acted on it: {reason}",
        actor=actor,
    )


# -- what people and models read -------------------------------------------------------------
def _iso(value: dt.datetime | None) -> str | None:
    v = as_utc(value)
    return v.isoformat() if v else None


def _op_brief(op: Operation | None) -> dict[str, Any] | None:
    if op is None:
        return None
    return {
        "operation_id": op.id,
        "idempotency_key": op.idempotency_key,
        "provider_key": op.provider_key or op.idempotency_key,
        "status": op.status,
        "reason": op.reason,
        "attempts": op.attempt_count,
        "result_reference": op.result_reference,
    }


def run_json(session: Session, run: Run) -> dict[str, Any]:
    """The run as every surface shows it, with ``outcome`` and ``model_message`` for a model."""
    steps = steps_from_json(run.steps or "[]")
    ops = step_operations(session, run, steps)
    spent = usage(session, run, steps)
    rows = []
    for step in steps:
        op = ops.get(step.key(run.run_key))
        comp = ops.get(step.compensation_key(run.run_key)) if step.compensate else None
        state = op.status if op is not None else ("not_sent" if RunStatus(run.status) not in ACTIVE else "pending")
        rows.append(
            {
                "name": step.name,
                "action": step.action,
                "idempotency_key": step.key(run.run_key),
                "state": state,
                "phase": step.phase,
                "irreversible": step.irreversible,
                "operation": _op_brief(op),
                "compensation": None
                if step.compensate is None
                else {
                    "action": step.compensate.action,
                    "key": step.compensation_key(run.run_key),
                    "operation": _op_brief(comp),
                },
            }
        )
    holder = next((o for o in ops.values() if o.id == run.current_op_id), None)
    # A step said "no effect" and its provider later confirmed one (late evidence): a person reviews.
    contradicted = [o.idempotency_key for o in ops.values() if o.status == Status.RECONCILIATION_REQUIRED.value]
    data = {
        "run_id": run.id,
        "tenant": run.tenant,
        "run_key": run.run_key,
        "subject": run.subject,
        "status": run.status,
        "meaning": RUN_MEANING[RunStatus(run.status)],
        "reason": run.reason,
        "holding": None
        if holder is None or RunStatus(run.status) not in ACTIVE
        else {"step": run.holding_step, "operation_id": holder.id, "status": holder.status, "why": holder.reason},
        "steps": rows,
        "priority": run.priority,
        "budget": {
            "max_attempts": run.max_attempts,
            "deadline_at": _iso(run.deadline_at),
            "used": spent.used,
            "dispatches": spent.dispatches,
            "retries": spent.retries,
            "lookups": spent.lookups,
        },
        "waiting_for_person": contradicted,
        "cancel_requested": run.cancel_requested,
        "compensate_requested": run.compensate_requested,
        "resolved_by": run.resolved_by,
        "note": run.note,
        "created_at": _iso(run.created_at),
        "updated_at": _iso(run.updated_at),
        "finished_at": _iso(run.finished_at),
        "history": run.history or [],
    }
    outcome = run_outcome(run, holder, contradicted)
    return data | {"outcome": outcome.value, "model_message": run_message(run, outcome, holder, steps, ops)}


_RUN_OUTCOME: dict[RunStatus, Outcome] = {
    RunStatus.SUCCEEDED: Outcome.SUCCEEDED,
    RunStatus.FAILED: Outcome.FAILED_BEFORE_COMMIT,
    RunStatus.COMPENSATED: Outcome.FAILED_BEFORE_COMMIT,
    RunStatus.CANCELLED: Outcome.CANCELLED,
    RunStatus.NEEDS_PERSON: Outcome.NEEDS_HUMAN,
    RunStatus.RESOLVED: Outcome.NEEDS_HUMAN,
}


def run_outcome(run: Run, holder: Operation | None, contradicted: list[str]) -> Outcome:
    status = RunStatus(run.status)
    if contradicted:
        return Outcome.NEEDS_HUMAN
    if status in ACTIVE:
        if holder is None:
            return Outcome.PENDING
        held = outcome_of(holder.status)
        return held if held in (Outcome.UNKNOWN, Outcome.NEEDS_HUMAN, Outcome.AWAITING_APPROVAL) else Outcome.PENDING
    return _RUN_OUTCOME[status]


def run_message(run: Run, outcome: Outcome, holder: Operation | None, steps: Any, ops: dict[str, Operation]) -> str:
    """One sentence for the model, in the operations' vocabulary (outbox/ledger/typed_outcome.py)."""
    name = f"run {run.run_key}"
    refs = [
        f"{s.name}: {o.result_reference}" for s in steps if (o := ops.get(s.key(run.run_key))) and o.result_reference
    ]
    if outcome is Outcome.SUCCEEDED:
        return (
            f"Done: {name} succeeded, all {len(steps)} steps"
            + (f" ({'; '.join(refs)})" if refs else "")
            + "; do not retry."
        )
    if outcome is Outcome.FAILED_BEFORE_COMMIT:
        return f"Not completed: {name} ({run.reason}); no effect of it remains. A changed run needs a new run key."
    if outcome is Outcome.CANCELLED:
        return f"Cancelled: {name} ({run.reason})."
    if outcome is Outcome.NEEDS_HUMAN:
        return f"A person is handling {name} ({run.reason}); do not retry, and do not tell the user it failed."
    step = run.holding_step or "its next step"
    if outcome is Outcome.UNKNOWN:
        return f"In progress: {name} waits for step {step}, whose outcome is being checked with the provider; do not retry."
    if outcome is Outcome.AWAITING_APPROVAL:
        return f"{name} waits for a person's approval of step {step}; nothing of that step has been sent. Wait, or check later."
    return f"In progress: {name} is at step {step}; wait for it or check later, do not resubmit."
