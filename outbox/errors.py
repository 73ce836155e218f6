"""One root, few leaves: every error agent-outbox raises on purpose."""

from __future__ import annotations


class OutboxError(Exception):
    """Base class for agent-outbox errors."""


class ConfigError(OutboxError):
    """A setting is missing or malformed; the message names the variable and the fix."""


class MissingDependency(ConfigError, ImportError):
    """What the configuration asks for (a PostgreSQL ledger, the sandbox) needs a package this install
    left out; the message names what to install."""


class InvalidIntent(OutboxError, ValueError):
    """The intent cannot be accepted as given; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class IdempotencyConflict(OutboxError):
    """The key was already used for an intent with different arguments."""

    def __init__(self, key: str, stored_digest: str, new_digest: str, operation_id: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was already used for operation {operation_id} "
            "with different arguments; use a new key for a new intent"
        )
        self.key, self.stored_digest, self.new_digest = key, stored_digest, new_digest
        self.operation_id = operation_id


class KeySpaceConflict(IdempotencyConflict):
    """The key belongs to the other kind of operation: a plain intent's key used by a run's step, or
    a run's step (or compensation) key used by a plain submit. Neither adopts the other's operation."""

    def __init__(self, key: str, operation_id: str, *, owner: str) -> None:
        OutboxError.__init__(
            self,
            f"idempotency key {key!r} belongs to {owner} (operation {operation_id}); "
            + (
                "a run's steps never adopt a plain intent's operation: use another run_key"
                if owner == "a plain intent"
                else "a plain intent never answers for a run's step: use another key"
            ),
        )
        self.key, self.stored_digest, self.new_digest = key, "", ""
        self.operation_id, self.owner = operation_id, owner


class Refused(OutboxError):
    """A call refused at submit by a rule of the actions file, nothing stored: a business answer for
    the caller (typed outcome REFUSED), not a malformed request. ``model_message`` says why and what
    the caller may do."""

    outcome = "REFUSED"

    def __init__(self, model_message: str) -> None:
        super().__init__(model_message)
        self.model_message = model_message


class BudgetExhausted(Refused):
    """The conversation's budget (``budget_scope`` in the actions file) has no room for this call."""

    def __init__(self, model_message: str, *, scope: str, left: dict[str, object]) -> None:
        super().__init__(model_message)
        self.scope, self.left = scope, left


class ObjectBusy(Refused):
    """The business object the call touches is held by an operation whose outcome is not known yet,
    and the action refuses instead of waiting (``when_object_busy: refuse``)."""

    def __init__(
        self, model_message: str, *, object_key: str, blocking_operation_id: str, blocking_status: str
    ) -> None:
        super().__init__(model_message)
        self.object_key, self.blocking_operation_id, self.blocking_status = (
            object_key,
            blocking_operation_id,
            blocking_status,
        )


class SubjectStopped(Refused):
    """An operator stopped the intent's subject (``agent-outbox subjects stop``): its new intents are
    refused, nothing stored, until they resume it. ``stopped_by`` / ``stopped_at`` / ``why``: the stop."""

    def __init__(
        self, model_message: str, *, tenant: str, subject: str, stopped_by: str, stopped_at: str, why: str | None
    ) -> None:
        super().__init__(model_message)
        self.tenant, self.subject, self.stopped_by, self.stopped_at, self.why = (
            tenant,
            subject,
            stopped_by,
            stopped_at,
            why,
        )

    def as_dict(self) -> dict[str, str | None]:
        return {
            "subject": self.subject,
            "stopped_by": self.stopped_by,
            "stopped_at": self.stopped_at,
            "reason": self.why,
        }


class SelfApproval(OutboxError):
    """Separation of duties: the identity that submitted an intent may not approve it."""

    def __init__(self, operation_id: str, identity: str) -> None:
        super().__init__(
            f"{identity} submitted the intent {operation_id} and cannot approve it (separate_approver): "
            "another key or person must decide"
        )
        self.operation_id, self.identity = operation_id, identity


class RunConflict(OutboxError):
    """The run key was already used for a run with different steps or budget."""

    def __init__(self, run_key: str, run_id: str) -> None:
        super().__init__(
            f"run key {run_key!r} was already used for run {run_id} with different steps or budget; "
            "use a new run key for a changed run"
        )
        self.run_key, self.run_id = run_key, run_id


class RunNotMovable(InvalidIntent):
    """The run is not in a state this request can act on (cancel a finished run, resolve a moving one)."""


class NotFound(OutboxError, LookupError):
    """Nothing of that kind has that id for the caller. Another tenant's record is not found either:
    a surface answers the same whether it exists elsewhere or nowhere (``what`` names the kind)."""

    what = "record"


class RunNotFound(NotFound):
    """No run has that id (or tenant + run key)."""

    what = "run"


class HandoffNotFound(NotFound):
    """No handoff has that id (in the caller's tenant)."""

    what = "handoff"


class ReportNotFound(NotFound):
    """No reconciliation report was kept in the ledger yet."""

    what = "report"


class StaleFence(OutboxError):
    """Another worker owns this operation now (or it moved on); our write was refused."""

    def __init__(self, operation_id: str, token: int, detail: str = "") -> None:
        msg = f"operation {operation_id}: fencing token {token} is no longer current"
        super().__init__(f"{msg} ({detail})" if detail else msg)
        self.operation_id, self.token = operation_id, token


class IllegalTransition(OutboxError):
    """The state machine does not allow this transition (see outbox/ledger/states.py)."""

    def __init__(self, operation_id: str, current: str, new: str) -> None:
        super().__init__(f"operation {operation_id}: {current} -> {new} is not an allowed transition")
        self.operation_id, self.current, self.new = operation_id, current, new


class OperationNotFound(NotFound):
    """No operation has that id (or tenant + idempotency key)."""

    what = "operation"
