"""Submit: write an intent into the outbox inside the caller's transaction.

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

from outbox.errors import IdempotencyConflict, InvalidIntent, KeySpaceConflict, ObjectBusy
from outbox.ledger import budget_scopes, key_uses, objects, stops, tracing
from outbox.ledger.drivers import NewOperation, driver_for
from outbox.ledger.drivers.base import Inserted
from outbox.ledger.envelope import build_envelope
from outbox.ledger.models import KEY_SPACES, Operation, core_table
from outbox.ledger.provider_keys import KeyRules, rule_for
from outbox.ledger.states import Status, WaitingFor
from outbox.ledger.tracing import validate_traceparent

MAX_KEY_LEN = 255
# Ten years: any longer is a mistake (and past what the database's interval arithmetic holds).
MAX_SECONDS = 10 * 365 * 86400.0
# Claim order within a tenant's share: higher is claimed sooner; 0 is everyone's default. A small
# range keeps it a ranking among a tenant's own intents, not a second queue to manage.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
PRIORITY_RULE = f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, higher runs sooner"

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


def _validate_key(key: Any) -> str:
    if not isinstance(key, str) or not key.strip():
        raise InvalidIntent("idempotency_key", "required: a stable business key such as 'wf-81:invoice-17:refund-2:v1'")
    if key != key.strip() or len(key) > MAX_KEY_LEN:
        raise InvalidIntent("idempotency_key", f"must be 1-{MAX_KEY_LEN} characters without surrounding whitespace")
    return key


def require_storable(name: str, text: str | None) -> None:
    """Text the database can store: no lone surrogate (\\ud800 in JSON) and no NUL character."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidIntent(name, "must be valid Unicode text (it holds a lone surrogate)") from None
    if "\x00" in text:
        raise InvalidIntent(name, "must not contain a NUL character")


def validate_priority(priority: Any, field: str = "priority") -> int:
    """The priority as stored; ``InvalidIntent`` naming ``field`` and the rule otherwise."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidIntent(field, PRIORITY_RULE)
    return priority


def submit(
    session: Session,
    *,
    tenant: str,
    idempotency_key: str,
    action: str,
    args: dict[str, Any],
    subject: str,
    run_id: str | None = None,
    tool_call_id: str | None = None,
    max_attempts: int | None = None,
    deadline_s: float | None = None,
    delay_s: float = 0.0,
    requires_approval: bool = False,
    key_rules: KeyRules | None = None,
    provider_key: str | None = None,
    submitted_by: str | None = None,
    key_space: str = "intent",
    priority: int = 0,
    traceparent: str | None = None,
    budget_scope: str | None = None,
) -> Receipt:
    """Write one intent in the caller's transaction and return its receipt (never commits).

    ``max_attempts`` / ``deadline_s`` cap this intent's retry budget; None leaves it to the
    action's budget in the actions file. The tighter of the two applies.

    ``key_rules``: where the action's ``provider_key`` template is found (the loaded actions file,
    workers.provider.actions.ActionsConfig); None uses the default ``{tenant}:{idempotency_key}``. The key
    the provider will see is rendered here, once, and stored with the intent. ``provider_key``: a
    key rendered earlier, with the intent (a run's later steps: outbox/runs/lifecycle.py), used as given.

    ``traceparent``: the W3C trace context the intent belongs to (an HTTP header, an MCP request's
    meta); None: the caller's current trace, when a tracer is installed (outbox/ledger/tracing.py).
    Stored with the intent, not digested. The submit is a span of that trace (``outbox.submit``).

    ``budget_scope``: the conversation (MCP session, run context, thread id) whose budget a new intent
    is charged to, when the actions file declares one for the action (``budget_scope:``); a refusal
    raises BudgetExhausted and stores nothing (outbox/ledger/budget_scopes.py). An action that declares
    its business ``object`` is rendered here; with ``when_object_busy: refuse`` a new intent on an
    object in doubt raises ObjectBusy (outbox/ledger/objects.py). A subject an operator stopped raises
    SubjectStopped (outbox/ledger/stops.py). None is stored by a refusal, and a replay of an intent
    already accepted is answered as always.
    """
    key = _validate_key(idempotency_key)
    priority = validate_priority(priority)
    traceparent = validate_traceparent(traceparent)
    env = build_envelope(tenant=tenant, action=action, args=args, subject=subject)
    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        raise InvalidIntent("max_attempts", "must be an integer >= 1 (or None: the action's budget)")
    if deadline_s is not None and not (isinstance(deadline_s, (int, float)) and 0 < deadline_s <= MAX_SECONDS):
        raise InvalidIntent("deadline_s", f"must be a positive number of seconds up to {MAX_SECONDS:.0f} (or None)")
    if not isinstance(delay_s, (int, float)) or not 0 <= delay_s <= MAX_SECONDS:
        raise InvalidIntent("delay_s", f"must be >= 0 and at most {MAX_SECONDS:.0f} seconds")
    for name, ref in (("run_id", run_id), ("tool_call_id", tool_call_id)):
        if ref is not None and (not isinstance(ref, str) or len(ref) > 255):
            raise InvalidIntent(name, "must be a string of at most 255 characters")
    for name, text in (
        ("idempotency_key", key),
        ("tenant", env.tenant),
        ("action", env.action),
        ("subject", env.subject),
        ("run_id", run_id),
        ("tool_call_id", tool_call_id),
        ("submitted_by", submitted_by),
    ):
        require_storable(name, text)
    if submitted_by is not None and not (isinstance(submitted_by, str) and 0 < len(submitted_by) <= 255):
        raise InvalidIntent("submitted_by", "must be a string of 1-255 characters (an identity such as 'key:12')")
    if key_space not in KEY_SPACES:
        raise ValueError(f"key_space must be one of {KEY_SPACES}")

    object_rule = key_rules.object_rule(env.action) if key_rules is not None else None
    object_key = object_rule.render(env.args) if object_rule is not None else None
    budgets = key_rules.budgets_of(env.action) if key_rules is not None and budget_scope is not None else ()
    if budget_scope is not None:
        budget_scope = budget_scopes.validate_scope(budget_scope)
        require_storable("budget_scope", budget_scope)

    operation_id = str(uuid.uuid4())
    # The actions file's approval rule (the send checks it again: outbox/approvals/decisions.py).
    requires_approval = requires_approval or (key_rules is not None and key_rules.needs_approval(env.action, env.args))
    status = Status.AWAITING_APPROVAL if requires_approval else Status.NOT_DISPATCHED
    reason = f"subject {env.subject}" + (f", run {run_id}" if run_id else "")
    if provider_key is None:
        provider_key = rule_for(key_rules, env.action).render(tenant=env.tenant, idempotency_key=key, action=env.action)
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
        tool_call_id=tool_call_id,
        status=status,
        waiting_for=WaitingFor.APPROVAL if requires_approval else None,
        max_attempts=max_attempts,
        deadline_s=None if deadline_s is None else float(deadline_s),
        delay_s=float(delay_s),
        reason=reason,
        submitted_by=submitted_by,
        key_space=key_space,
        priority=priority,
        object_key=object_key,
        budget_scope=budget_scope if budgets else None,
        # The definition its requests are built from (outbox/ledger/request_record.py says why).
        action_version=key_rules.action_version(env.action) if key_rules is not None else None,
    )
    rules = _Rules(object_rule, budgets, budget_scope)
    if key_space == "intent":  # a run's steps are its run's: refused with the run, held at their claim
        stops.refuse_if_stopped(session, tenant=env.tenant, subject=env.subject, replay=lambda: _known(session, new))
    with tracing.span(
        "outbox.submit", parent=traceparent, attributes={"outbox.tenant": env.tenant, "outbox.action": env.action}
    ) as span:
        # Stored: this submit's span when traced (later work continues it), else the caller's.
        return _insert(session, span, replace(new, traceparent=span.traceparent), rules, env.args)


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
