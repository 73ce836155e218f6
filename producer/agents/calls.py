"""One idea of a tool call, shared by every agent adapter: submitted as an intent under the call's key
(producer/agents/call_keys.py: the same call again is the same operation, ``occurrence`` makes another
one on purpose), answered with its typed outcome (outbox/ledger/typed_outcome.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from sqlalchemy import select

from outbox.actions.rules import ActionRules
from outbox.errors import BudgetExhausted, IdempotencyConflict, InvalidIntent, ObjectBusy, OperationNotFound, Refused
from outbox.ledger.envelope import canonical_value, dumps_canonical, loads_exact
from outbox.ledger.intent import Intent
from outbox.ledger.models import Operation
from outbox.ledger.typed_outcome import SETTLED, Outcome, model_message, outcome_of, with_outcome
from outbox.reads.queries import operation_json, submitted_detail
from outbox.service import approvals, operations, waiting
from producer.agents.call_keys import as_text, call_key, exact, retry_key
from producer.agents.catalog import OCCURRENCE, RESERVED, RETRY_OF, ToolView, catalog, tool_for
from producer.client import Outbox

# Final outcomes that say "it did not happen": the only ones a call may be tried again after. Not
# CANCELLED: a person's denial is not the model's to route around.
RETRYABLE = frozenset({Outcome.FAILED_BEFORE_COMMIT, Outcome.FAILED_AT_PROVIDER})


def refused_answer(exc: Refused, *, action: str, idempotency_key: str) -> ToolAnswer:
    """The answer to a call the actions file's rules refused at submit (nothing stored): its budget
    left, or the operation its object waits behind."""
    waiting_on = None
    if isinstance(exc, ObjectBusy):
        waiting_on = {
            "operation_id": exc.blocking_operation_id,
            "status": exc.blocking_status,
            "object": exc.object_key,
        }
    budget = None
    if isinstance(exc, BudgetExhausted):
        budget = exc.left
    return ToolAnswer(
        outcome=exc.outcome,
        model_message=exc.model_message,
        operation_id=None,
        status="refused",
        action=action,
        idempotency_key=idempotency_key,
        reference=None,
        new=False,
        budget=budget,
        waiting_on=waiting_on,
    )


def check_schema(schema: dict[str, Any], args: dict[str, Any]) -> None:
    """The tool's input schema, enforced (not only shown to the model): the first violation names
    its field. Floats are checked as the numbers they are."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(args), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.absolute_path)
        if first.validator == "additionalProperties":
            extra = sorted(set(first.instance) - set(first.schema.get("properties", {})))
            where = ".".join(filter(None, [where, extra[0] if extra else ""]))
        elif first.validator == "required":
            missing = [r for r in first.validator_value if r not in first.instance]
            where = ".".join(filter(None, [where, missing[0] if missing else ""]))
        raise InvalidIntent(f"args.{where}" if where else "args", first.message)


@dataclass(frozen=True)
class ToolAnswer:
    """What a tool returns to the model: the typed outcome and one sentence (outbox/ledger/typed_outcome.py)."""

    outcome: str
    model_message: str
    operation_id: str | None  # None only for REFUSED: nothing was stored
    status: str  # the operation's state; "refused" when nothing was stored
    action: str
    idempotency_key: str
    reference: str | None
    new: bool
    conflict: bool = False  # a call about the same reference with other arguments: this is the first one
    # With a budget scope: {"left": "3 of 20 calls ... left in this conversation", "budgets": [...]}.
    budget: dict[str, Any] | None = None
    # The operation on the same business object this one waits behind (or was refused for).
    waiting_on: dict[str, Any] | None = None
    # With PENDING: QUEUED (nothing sent yet), IN_PROGRESS, or ACCEPTED (by the provider, not finished).
    stage: str | None = None

    @property
    def settled(self) -> bool:
        return Outcome(self.outcome) in SETTLED

    @property
    def stored_id(self) -> str:
        """The operation's id, for a call that made (or found) one; InvalidIntent for a refused call."""
        if self.operation_id is None:
            raise InvalidIntent("operation_id", "this call was refused and stored nothing: there is no operation")
        return self.operation_id

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ToolCaller:
    """Submits tool calls as intents of one tenant and answers with their outcome."""

    def __init__(
        self, outbox: Outbox, rules: ActionRules, *, tenant: str, subject: str, identity: str | None = None
    ) -> None:
        """``identity``: who submits, as separation of duties compares it (``key:<id>`` over MCP's HTTP
        transport); None in-process, where the host is the only one submitting."""
        self.outbox, self.rules, self.tenant, self.subject = outbox, rules, tenant, subject
        self.identity = identity
        self.tools: dict[str, ToolView] = catalog(rules)

    def call(
        self,
        action: str,
        args: dict[str, Any],
        *,
        scope: str,
        tool_call_id: str | None = None,
        priority: Any = 0,
        traceparent: Any = None,
    ) -> ToolAnswer:
        """Submit (or find) the intent of this call and answer its outcome now. Raises InvalidIntent
        (field named) for bad input: nothing is submitted then.

        ``args`` may carry ``retry_of``: the operation of this same call that ended with a final "did
        not happen" (FAILED_BEFORE_COMMIT, FAILED_AT_PROVIDER). The call is then tried again under a key
        of its own, ``{key}:retry-of={operation_id}``: it cannot collide with the failed record, and a
        repeat of the retry is the same operation again. Anything else named there is refused.

        ``priority``: the host's (-100..100, higher is claimed sooner; outbox/ledger/submit.py), never
        an argument of the tool: an action may have a business argument of that name."""
        tool = tool_for(self.tools, action)
        key = self.key_of(action, args, scope=scope)
        plain = {k: v for k, v in args.items() if k not in RESERVED}
        if args.get(RETRY_OF) is not None:
            self._check_retry(tool, args[RETRY_OF], plain, scope=scope)
        exact_args = exact(plain)
        intent = Intent(
            tenant=self.tenant,
            idempotency_key=key,
            action=action,
            args=exact_args,
            subject=self.subject,
            submitted_by=self.identity,
            run_id=scope,
            tool_call_id=tool_call_id,
            requires_approval=tool.needs_approval(exact_args),
            priority=priority,
            traceparent=traceparent,
            budget_scope=scope,
        )
        try:
            receipt = self.outbox.submit(intent)
        except Refused as exc:
            return refused_answer(exc, action=action, idempotency_key=key)
        except IdempotencyConflict as exc:
            # The same business object (reference arguments), other arguments: the first call stands.
            first = self.get(exc.operation_id, replay=True)  # an earlier call made it
            refs = ", ".join(f"{a}={args.get(a)!r}" for a in tool.reference_args)
            said = (
                f"A call of {action} for {refs} was already made with other arguments; it stands and no second "
                f"one is made (to make another one on purpose, call again with occurrence=2). {first.model_message}"
            )
            return replace(first, model_message=said, conflict=True)
        # A new call is answered as its insert wrote it (as the HTTP API answers), not as a read after
        # the commit finds it: a fast worker may have sent it already, and the model would be told
        # "already done" of the call it has just made.
        answer = (
            self._answer(with_outcome(submitted_detail(*receipt.written).as_json()), new=True)
            if receipt.written is not None
            else self.get(receipt.operation_id, new=receipt.new, replay=not receipt.new)
        )
        extras = receipt.extras()
        message = answer.model_message
        if receipt.waiting_on is not None and not answer.settled:
            message += (
                f" It waits, nothing sent: {receipt.waiting_on.describe()}; it is sent once that outcome is known."
            )
        if receipt.budget_left:
            message += f" Budget: {receipt.budget_left}."
        return replace(answer, model_message=message, budget=extras.get("budget"), waiting_on=extras.get("waiting_on"))

    def key_of(self, action: str, args: dict[str, Any], *, scope: str) -> str:
        """This call's idempotency key, once its arguments match the tool's schema (InvalidIntent if not)."""
        tool = tool_for(self.tools, action)
        if not isinstance(args, dict):
            raise InvalidIntent("args", "must be an object of the tool's arguments")
        check_schema(tool.input_schema, args)
        plain = {k: v for k, v in args.items() if k not in RESERVED}
        key = call_key(scope, action, plain, tool.reference_args, args.get(OCCURRENCE))
        retry_of = args.get(RETRY_OF)
        return key if retry_of is None else retry_key(key, action, retry_of)

    def _check_retry(self, tool: ToolView, retry_of: Any, args: dict[str, Any], *, scope: str) -> None:
        """``retry_of`` must name a final "did not happen" of this very call: same tenant, action and
        scope, and the same business object (reference arguments) or the same arguments. Otherwise a
        retry_of could mint a fresh key for a call that succeeded, and act twice."""
        found = self._operation(retry_of) if isinstance(retry_of, str) else None
        if found is None:
            raise InvalidIntent(
                RETRY_OF, f"no operation {retry_of!r} of this tenant: name the operation_id of the failed call"
            )
        op, outcome = found
        if op.action != tool.action or op.run_id != scope or not self._same_call(tool, op, args):
            raise InvalidIntent(
                RETRY_OF,
                f"operation {op.id} was another call (another action, conversation or object); leave retry_of out: "
                "this call is answered on its own",
            )
        if outcome not in RETRYABLE:
            raise InvalidIntent(
                RETRY_OF,
                f"operation {op.id} is {outcome.value}: only a call that ended FAILED_BEFORE_COMMIT or "
                "FAILED_AT_PROVIDER may be tried again; leave retry_of out and read that call's outcome",
            )

    def _operation(self, operation_id: str) -> tuple[Operation, Outcome] | None:
        with self.outbox.sessions() as session:
            try:
                op = operations.get(session, self.tenant, operation_id)
            except OperationNotFound:
                return None
            session.expunge(op)
        return op, outcome_of(op.status)

    @staticmethod
    def _same_call(tool: ToolView, op: Operation, args: dict[str, Any]) -> bool:
        if op.args is None:  # purged by retention: no way to tell
            return False
        before = loads_exact(op.args)
        now = canonical_value(exact(args))
        if tool.reference_args:
            return all(as_text(before.get(a)) == as_text(now.get(a)) for a in tool.reference_args)
        return bool(dumps_canonical(canonical_value(before)) == dumps_canonical(now))

    def find(self, action: str, args: dict[str, Any], *, scope: str) -> ToolAnswer | None:
        """The operation this call already made, if any (nothing is submitted)."""
        key = self.key_of(action, args, scope=scope)
        with self.outbox.sessions() as session:
            found = session.execute(
                select(Operation.id).where(Operation.tenant == self.tenant, Operation.idempotency_key == key)
            ).scalar()
        return None if found is None else self.get(found)

    def get(self, operation_id: str, *, new: bool = False, replay: bool = False) -> ToolAnswer:
        """The operation as it is now. ``replay``: the answer to a call that found the operation an
        earlier call made (its success reads "Already done"; any other answer, "Done")."""
        with self.outbox.sessions() as session:
            try:
                op = operations.get(session, self.tenant, operation_id)
            except OperationNotFound:
                # To a model, a wrong id is a wrong argument: it corrects the call.
                raise InvalidIntent("operation_id", f"no operation {operation_id!r} for this tenant") from None
            doc = with_outcome(operation_json(op), replay=replay)
        return self._answer(doc, new=new)

    def _answer(self, doc: dict[str, Any], *, new: bool) -> ToolAnswer:
        result = doc.get("result") or {}
        message = doc["model_message"]
        if Outcome(doc["outcome"]) in RETRYABLE:
            message = model_message(doc, again=self._again(doc["action"], doc["operation_id"]))
        return ToolAnswer(
            outcome=doc["outcome"],
            model_message=message,
            operation_id=doc["operation_id"],
            status=doc["status"],
            action=doc["action"],
            idempotency_key=doc["idempotency_key"],
            reference=result.get("reference"),
            new=new,
            stage=doc.get("stage"),
        )

    def _again(self, action: str, operation_id: str) -> str:
        """How the model tries this call again after a final "did not happen" (``retry_of``)."""
        tool = self.tools.get(action)
        refs = ", ".join(tool.reference_args) if tool is not None else ""
        if refs:
            return (
                f"Calling it again answers the same; once the cause is fixed, call this tool again for the same {refs} "
                f'with retry_of="{operation_id}" (the arguments may be corrected).'
            )
        return (
            "Calling it again with the same arguments answers the same; once the cause is fixed, call this tool "
            f'again with retry_of="{operation_id}". A call with changed arguments is a new call and needs no retry_of.'
        )

    def wait(
        self, operation_id: str, *, timeout_s: float = 30.0, interval_s: float = waiting.POLL_S, replay: bool = False
    ) -> ToolAnswer:
        """Until the outcome is settled (final, or a person is needed) or ``timeout_s`` (at most 60).
        ``replay``: waited for by a call that found an earlier call's operation (see ``get``)."""
        waiting.timeout_of(timeout_s)
        answer = self.get(operation_id, replay=replay)
        if answer.settled or not timeout_s:
            return answer
        waiting.wait(self.outbox.sessions, operation_id, timeout_s=timeout_s, poll_s=interval_s)
        return self.get(operation_id, replay=replay)

    def approve(self, operation_id: str, *, by: str, note: str | None = None) -> None:
        """A person's approval, recorded as agent-outbox approvals are (who, when, under which policy).
        Adapters call it only for the operation of the very call the person saw (not a ``conflict``)."""
        with self.outbox.sessions.begin() as session:
            approvals.approve(session, self.tenant, operation_id, by=by, note=note, policies=self.rules.approvals)

    def deny(self, operation_id: str, *, by: str, note: str) -> None:
        with self.outbox.sessions.begin() as session:
            approvals.deny(session, self.tenant, operation_id, by=by, note=note)
