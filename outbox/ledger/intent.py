"""An intent as the ledger inserts it: one value that every surface builds and ``submit`` takes.

What an agent asks for (tenant, idempotency key, action, arguments, subject) and how it is to be
carried out (priority, retry budget, delay, approval, trace, conversation budget) travel together,
as River's ``InsertOpts`` travel with a job's args. Building an ``Intent`` validates it, here and
nowhere else: a bad field raises ``InvalidIntent(field, message)`` naming the field and the fix,
before any database work. A built intent is valid and never changes: its arguments are held in
their canonical form (outbox/ledger/envelope.py), computed once, so a caller who changes its own
dict afterwards changes nothing here, and the ledger writes exactly what was checked.

The actions file's rules (provider key templates, approval rules, objects, budgets) are not part
of the intent: the ledger applies them at submit (``submit(session, intent, rules=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from outbox.errors import InvalidIntent
from outbox.ledger.budget_scopes import validate_scope
from outbox.ledger.envelope import Envelope, build_envelope
from outbox.ledger.models import KEY_SPACES
from outbox.ledger.tracing import validate_traceparent

MAX_KEY_LEN = 255
# The width of the columns that hold a reference or an identity (run_id, tool_call_id, submitted_by,
# provider_key): the ledger's String(255).
MAX_REF_LEN = 255
# Ten years: any longer is a mistake (and past what the database's interval arithmetic holds).
MAX_SECONDS = 10 * 365 * 86400.0
# Claim order within a tenant's share: higher is claimed sooner; 0 is everyone's default. A small
# range keeps it a ranking among a tenant's own intents, not a second queue to manage.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
PRIORITY_RULE = f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, higher runs sooner"


@dataclass(frozen=True, kw_only=True)
class Intent:
    """One intent, validated: what ``outbox.ledger.submit.submit`` writes.

    ``max_attempts`` / ``deadline_s`` cap this intent's retry budget; None leaves it to the action's
    budget in the actions file (the tighter of the two applies). ``delay_s``: not due before then.
    ``requires_approval``: waits for a person even when the actions file asks for no approval.
    ``provider_key``: a key rendered earlier, with the intent (a run's later steps, a retry as a new
    intent), used as given; None renders the action's template at submit. ``submitted_by``: who
    submits, as separation of duties compares it (``key:12``). ``key_space``: ``intent``, or ``run``
    for a run's step or compensation (keyed by its run, not by a caller). ``priority``: -100..100,
    higher is claimed sooner among the tenant's due intents; stored, not digested. ``traceparent``:
    the W3C trace context it belongs to, None for the caller's current one; stored, not digested.
    ``budget_scope``: the conversation (MCP session, run context, thread id) charged for it when the
    actions file gives its action a ``budget_scope:``.
    """

    tenant: str
    idempotency_key: str
    action: str
    args: dict[str, Any]
    subject: str
    run_id: str | None = None
    tool_call_id: str | None = None
    max_attempts: int | None = None
    deadline_s: float | None = None
    delay_s: float = 0.0
    requires_approval: bool = False
    provider_key: str | None = None
    submitted_by: str | None = None
    key_space: str = "intent"
    priority: int = 0
    traceparent: str | None = None
    budget_scope: str | None = None
    # The canonical arguments and their digest, computed once by the validation.
    envelope: Envelope = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # One check after the other, in the order callers have always seen them: the first bad
        # field is the one named.
        _validate_key(self.idempotency_key)
        validate_priority(self.priority)
        traceparent = validate_traceparent(self.traceparent)
        env = build_envelope(tenant=self.tenant, action=self.action, args=self.args, subject=self.subject)
        max_attempts = self.max_attempts
        if max_attempts is not None and (
            not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
        ):
            raise InvalidIntent("max_attempts", "must be an integer >= 1 (or None: the action's budget)")
        deadline_s = self.deadline_s
        if deadline_s is not None and not (_is_number(deadline_s) and 0 < deadline_s <= MAX_SECONDS):
            raise InvalidIntent("deadline_s", f"must be a positive number of seconds up to {MAX_SECONDS:.0f} (or None)")
        if not (_is_number(self.delay_s) and 0 <= self.delay_s <= MAX_SECONDS):
            raise InvalidIntent("delay_s", f"must be >= 0 and at most {MAX_SECONDS:.0f} seconds")
        for name, ref in (("run_id", self.run_id), ("tool_call_id", self.tool_call_id)):
            if ref is not None and (not isinstance(ref, str) or len(ref) > MAX_REF_LEN):
                raise InvalidIntent(name, f"must be a string of at most {MAX_REF_LEN} characters")
        if self.submitted_by is not None and not (
            isinstance(self.submitted_by, str) and 0 < len(self.submitted_by) <= MAX_REF_LEN
        ):
            raise InvalidIntent(
                "submitted_by", f"must be a string of 1-{MAX_REF_LEN} characters (an identity such as 'key:12')"
            )
        for name, text in (
            ("idempotency_key", self.idempotency_key),
            ("tenant", env.tenant),
            ("action", env.action),
            ("subject", env.subject),
            ("run_id", self.run_id),
            ("tool_call_id", self.tool_call_id),
            ("submitted_by", self.submitted_by),
        ):
            require_storable(name, text)
        if self.key_space not in KEY_SPACES:
            raise InvalidIntent("key_space", f"must be one of {', '.join(KEY_SPACES)}")
        if self.provider_key is not None:
            if not (isinstance(self.provider_key, str) and 0 < len(self.provider_key) <= MAX_REF_LEN):
                raise InvalidIntent(
                    "provider_key", f"must be a string of 1-{MAX_REF_LEN} characters (or None: the action's template)"
                )
            require_storable("provider_key", self.provider_key)
        if self.budget_scope is not None:
            validate_scope(self.budget_scope)
            require_storable("budget_scope", self.budget_scope)
        # Held as validated: the canonical arguments (a copy the canonicalisation made anyway), the
        # trace context in lower case, the durations as floats, the approval flag as a bool.
        set_ = object.__setattr__
        set_(self, "envelope", env)
        set_(self, "args", env.args)
        set_(self, "traceparent", traceparent)
        set_(self, "deadline_s", None if deadline_s is None else float(deadline_s))
        set_(self, "delay_s", float(self.delay_s))
        set_(self, "requires_approval", bool(self.requires_approval))

    @property
    def args_digest(self) -> str:
        """sha256 of the canonical envelope: the intent's identity under its key."""
        return self.envelope.digest


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
