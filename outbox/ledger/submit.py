"""Submit: write an intent (an ``Intent``, outbox/ledger/intent.py) into the outbox inside the caller's
transaction: ``submit(session, intent, rules=...)``.

The point of an outbox is that the agent's own rows and its intent commit or roll back together, so
``submit`` never commits: the caller does. Two concurrent submits of the same (tenant, key) produce
one row: ``INSERT ... ON CONFLICT DO NOTHING`` lets exactly one win, the loser reads the winner's
row and compares digests (same digest = the same intent, a different one = ``IdempotencyConflict``).
On PostgreSQL the insert also queues a NOTIFY that the database delivers on commit (the driver's
one statement, outbox/ledger/drivers/sql/submit.sql).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import IdempotencyConflict, KeySpaceConflict, ObjectBusy
from outbox.ledger import budget_scopes, key_uses, objects, stops, tracing
from outbox.ledger.drivers import NewOperation, driver_for
from outbox.ledger.drivers.base import Inserted
from outbox.ledger.intent import Intent
from outbox.ledger.models import Operation, core_table
from outbox.ledger.provider_keys import SubmitRules, rule_for
from outbox.ledger.states import Status, WaitingFor

_OP = core_table(Operation)


@dataclass(frozen=True)
class Receipt:
    """What submit hands back to the agent runtime."""

    operation_id: str
    tenant: str
    idempotency_key: str
    status: str
    new: bool
    args_digest: str
    result_reference: str | None = None
    result: dict[str, Any] | None = None
    error_class: str | None = None
    provider_key: str | None = None  # what the provider sees (outbox/ledger/provider_keys.py)
    # With a budget scope: what the conversation has left of each budget (outbox/ledger/budget_scopes.py).
    budget: tuple[budget_scopes.Standing, ...] = ()
    # The operation its business object waits behind, when it was busy at submit (outbox/ledger/objects.py).
    waiting_on: objects.Blocker | None = None
    # A new row as written, with the times the database gave it: enough to answer the submit without
    # reading the row back (outbox/reads/queries.py submitted_detail). None for a replay.
    written: tuple[NewOperation, Inserted] | None = field(default=None, repr=False, compare=False)

    @property
    def budget_left(self) -> str | None:
        """'3 of 20 calls, 120.00 of 500.00 EUR left in this conversation' (None: no budget scope)."""
        return budget_scopes.describe(self.budget) or None if self.budget else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id,
            "tenant": self.tenant,
            "idempotency_key": self.idempotency_key,
            "provider_key": self.provider_key,
            "status": self.status,
            "new": self.new,
            "args_digest": self.args_digest,
            "result": (
                {"reference": self.result_reference, "response": self.result}
                if self.result_reference is not None or self.result is not None
                else None
            ),
            "error_class": self.error_class,
        } | self.extras()

    def extras(self) -> dict[str, Any]:
        """What a budget scope or a busy object adds to the answer (nothing when neither applies)."""
        out: dict[str, Any] = {}
        if self.budget:
            out["budget"] = {"left": self.budget_left, "budgets": [s.as_dict() for s in self.budget]}
        if self.waiting_on is not None:
            out["waiting_on"] = self.waiting_on.as_dict() | {"message": self.waiting_on.describe()}
        return out


def submit(session: Session, intent: Intent, *, rules: SubmitRules | None = None) -> Receipt:
    """Write one intent in the caller's transaction and return its receipt (never commits).

    The intent was validated when it was built (outbox/ledger/intent.py); what is left is what the
    actions file and the ledger's own rows decide. ``rules``: the loaded actions file
    (workers.provider.actions.ActionsFile); None uses the default provider key
    ``{tenant}:{idempotency_key}`` and no approval rule, object or budget. The key the provider will
    see is rendered here, once, and stored with the intent, unless the intent carries one already.

    The submit is a span (``outbox.submit``) of the intent's trace, or of the caller's current one
    when a tracer is installed (outbox/ledger/tracing.py); the trace is stored, not digested.

    An action whose rule asks for approval waits for a person (``awaiting_approval``). With a budget
    scope, a new intent is charged to the conversation when the actions file declares a budget for
    the action; a refusal raises BudgetExhausted and stores nothing (outbox/ledger/budget_scopes.py).
    An action that declares its business ``object`` is rendered here; with ``when_object_busy:
    refuse`` a new intent on an object in doubt raises ObjectBusy (outbox/ledger/objects.py). A
    subject an operator stopped raises SubjectStopped (outbox/ledger/stops.py). Nothing is stored by
    a refusal, and a replay of an intent already accepted is answered as always.
    """
    if not isinstance(intent, Intent):
        raise TypeError(
            f"submit takes an Intent, not {type(intent).__name__}: build one (outbox.ledger.intent.Intent), "
            "or call producer.submit with keywords"
        )
    env, key, run_id = intent.envelope, intent.idempotency_key, intent.run_id
    object_rule = rules.object_rule(env.action) if rules is not None else None
    object_key = object_rule.render(env.args) if object_rule is not None else None
    scope = intent.budget_scope
    budgets = rules.budgets_of(env.action) if rules is not None and scope is not None else ()

    operation_id = str(uuid.uuid4())
    # The actions file's approval rule (the send checks it again: outbox/approvals/decisions.py).
    requires_approval = intent.requires_approval or (rules is not None and rules.needs_approval(env.action, env.args))
    status = Status.AWAITING_APPROVAL if requires_approval else Status.NOT_DISPATCHED
    reason = f"subject {env.subject}" + (f", run {run_id}" if run_id else "")
    provider_key = intent.provider_key
    if provider_key is None:
        provider_key = rule_for(rules, env.action).render(tenant=env.tenant, idempotency_key=key, action=env.action)
    new = NewOperation(
        id=operation_id,
        tenant=env.tenant,
        idempotency_key=key,
        provider_key=provider_key,
        action=env.action,
        args=env.canonical_args,
        args_digest=env.digest,
        subject=env.subject,
        run_id=run_id,
        tool_call_id=intent.tool_call_id,
        status=status,
        waiting_for=WaitingFor.APPROVAL if requires_approval else None,
        max_attempts=intent.max_attempts,
        deadline_s=intent.deadline_s,
        delay_s=intent.delay_s,
        reason=reason,
        submitted_by=intent.submitted_by,
        key_space=intent.key_space,
        priority=intent.priority,
        object_key=object_key,
        budget_scope=scope if budgets else None,
        # The definition its requests are built from (outbox/ledger/request_record.py says why).
        action_version=rules.action_version(env.action) if rules is not None else None,
    )
    applying = _Rules(object_rule, budgets, scope)
    if intent.key_space == "intent":  # a run's steps are its run's: refused with the run, held at their claim
        stops.refuse_if_stopped(session, tenant=env.tenant, subject=env.subject, replay=lambda: _known(session, new))
    with tracing.span(
        "outbox.submit",
        parent=intent.traceparent,
        attributes={"outbox.tenant": env.tenant, "outbox.action": env.action},
    ) as span:
        # Stored: this submit's span when traced (later work continues it), else the caller's.
        return _insert(session, span, replace(new, traceparent=span.traceparent), applying, env.args)


@dataclass(frozen=True)
class _Rules:
    """What the actions file asks of this intent at submit beyond its row: its object, its budgets."""

    object_rule: objects.ObjectRule | None
    budgets: tuple[budget_scopes.ScopeLimit, ...]
    scope: str | None

    @property
    def guarded(self) -> bool:
        """Whether a new row may still be refused after its insert (a savepoint then)."""
        return bool(self.budgets) or self.refuses_busy

    @property
    def refuses_busy(self) -> bool:
        return self.object_rule is not None and self.object_rule.busy == "refuse"


def _insert(session: Session, span: tracing.Span, new: NewOperation, rules: _Rules, args: dict[str, Any]) -> Receipt:
    """Insert ``new``, or find the intent its key already names (a replay, or a conflict)."""
    operation_id, key = new.id, new.idempotency_key
    blocker = None
    if new.object_key is not None:
        blocker = objects.busy_at_submit(session, tenant=new.tenant, object_key=new.object_key, idempotency_key=key)
    spent: list[budget_scopes.Standing] = []
    if not rules.guarded:
        inserted = driver_for(session).insert_operation(session, new)
    else:
        try:
            with session.begin_nested():  # a refusal takes the row (and any charge) back with it
                inserted = driver_for(session).insert_operation(session, new)
                if inserted is not None and blocker is not None and rules.refuses_busy:
                    raise _busy(new, blocker)
                if inserted is not None and rules.budgets and rules.scope is not None:
                    spent = budget_scopes.charge(
                        session, tenant=new.tenant, scope=rules.scope, budgets=rules.budgets, args=args
                    )
        except budget_scopes.NoRoom as exc:
            assert rules.scope is not None
            raise budget_scopes.refusal(
                session, tenant=new.tenant, scope=rules.scope, budgets=rules.budgets, no_room=exc
            ) from None
    if inserted is not None:
        span.set(**{"outbox.operation_id": operation_id, "outbox.replay": False})
        return Receipt(
            operation_id,
            new.tenant,
            key,
            new.status.value,
            True,
            new.args_digest,
            provider_key=new.provider_key,
            budget=tuple(spent),
            waiting_on=blocker,
            written=(new, inserted),
        )

    existing = session.execute(
        select(
            _OP.c.id,
            _OP.c.status,
            _OP.c.args_digest,
            _OP.c.result_reference,
            _OP.c.result,
            _OP.c.error_class,
            _OP.c.provider_key,
            _OP.c.key_space,
        ).where(_OP.c.tenant == new.tenant, _OP.c.idempotency_key == key)
    ).one()
    span.set(**{"outbox.operation_id": existing.id, "outbox.replay": True})
    if existing.key_space != new.key_space:
        owner = "a plain intent" if existing.key_space == "intent" else "a run's step or compensation"
        raise KeySpaceConflict(key, existing.id, owner=owner)
    counted = new.key_space == "intent"  # a run's steps are keyed by the run: not a caller's key use
    if existing.args_digest != new.args_digest:
        if counted:
            key_uses.note(session, tenant=new.tenant, action=new.action, kind=key_uses.CONFLICTS)
        raise IdempotencyConflict(key, existing.args_digest, new.args_digest, existing.id)
    if counted:
        key_uses.note(session, tenant=new.tenant, action=new.action, kind=key_uses.REPLAYS)
    left: tuple[budget_scopes.Standing, ...] = ()
    if rules.budgets and rules.scope is not None:
        left = tuple(budget_scopes.standing(session, tenant=new.tenant, scope=rules.scope, budgets=rules.budgets))
    return Receipt(
        existing.id,
        new.tenant,
        key,
        existing.status,
        False,
        existing.args_digest,
        existing.result_reference,
        existing.result,
        existing.error_class,
        existing.provider_key,
        budget=left,
    )


def _known(session: Session, new: NewOperation) -> bool:
    """Whether the intent's key is taken already (a replay, answered as always; or a conflict)."""
    found = select(_OP.c.id).where(_OP.c.tenant == new.tenant, _OP.c.idempotency_key == new.idempotency_key)
    return session.execute(found).first() is not None


def _busy(new: NewOperation, blocker: objects.Blocker) -> ObjectBusy:
    return ObjectBusy(
        f"Refused: {blocker.describe()}; {new.action} on the same object is not accepted until that outcome is "
        f"known. Nothing was submitted or sent. Wait for operation {blocker.operation_id} to settle (read it), "
        "then call again.",
        object_key=blocker.object_key,
        blocking_operation_id=blocker.operation_id,
        blocking_status=blocker.status.value,
    )
