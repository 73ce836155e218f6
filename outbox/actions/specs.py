"""The parts of an action in the actions file: requests, lookups, listings, budgets, breakers, limits.

Plain pydantic models (unknown fields forbidden); workers/provider/actions.py puts them together into
targets and actions and checks what crosses models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import Decimal
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from outbox.actions.matching import KEY_PLACEHOLDER, Match, match_problem, placeholders
from outbox.ledger.budget_scopes import EVERY_TOOL, AmountCap, ScopeLimit
from outbox.ledger.objects import ObjectRule, template_fields
from outbox.privacy.masking import top_field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BreakerSpec(_Strict):
    fail_max: int = Field(default=5, gt=0)
    reset_timeout_s: float = Field(default=30.0, gt=0)
    success_threshold: int = Field(default=1, gt=0)


class RateLimitSpec(_Strict):
    """Requests per second a target (or one tenant at a target) accepts, shared by the whole fleet.

    ``burst``: how many may leave at once after a quiet spell; left out, one second's worth
    (``max(1, ceil(per_s))``), so a limit written as "50/s" admits 50 at once and then 50 a second.
    """

    per_s: float = Field(gt=0)
    burst: int | None = Field(default=None, ge=1)

    @property
    def burst_or_default(self) -> int:
        return self.burst if self.burst is not None else max(1, math.ceil(self.per_s))


class RequestSpec(_Strict):
    method: Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
    path: str
    query: dict[str, str] = Field(default_factory=dict)

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        placeholders(value)  # raises on malformed braces
        return value

    def placeholder_names(self) -> set[str]:
        names = placeholders(self.path)
        for template in self.query.values():
            names |= placeholders(template)
        return names


class ProviderIdempotency(_Strict):
    header: str = "Idempotency-Key"
    # How long the provider remembers a key; a replay after this window could run twice.
    retention_s: float = Field(gt=0)


class LookupSpec(_Strict):
    request: RequestSpec
    # Only an authoritative lookup's 404 counts as "never executed", and only after settle_s
    # (the provider's index lag) has passed since the last attempt.
    authoritative_not_found: bool = False
    settle_s: float = Field(default=5.0, ge=0)
    status_field: str = "status"
    succeeded: list[str] = Field(default_factory=lambda: ["succeeded"])
    pending: list[str] = Field(default_factory=lambda: ["pending", "processing"])
    failed: list[str] = Field(default_factory=lambda: ["failed", "canceled"])
    # Where a list-shaped lookup answer keeps its candidates (a dotted path); None tries data / items /
    # results. `items_field` is its older name, still read.
    items: str | None = Field(default=None, validation_alias=AliasChoices("items", "items_field"))
    # Field of a found object holding our key. In a lookup by key (its request names the key), objects
    # with another key are ignored (one without the field is the key's: the provider filtered), so a
    # provider that silently ignores the filter cannot make an unrelated effect "ours"; in a lookup by
    # reference it must hold our key exactly (an object without it is not ours), beside ``match``.
    key_field: str | None = None
    # Which fields of a found object must equal which arguments (outbox/actions/matching.py): a found
    # object that differs is not ours. Required when the lookup is not by the provider's key.
    match: Match = Field(default_factory=dict)
    # A POST that only reads (a search endpoint): declared, since a POST is otherwise a write.
    search: bool = False
    # What a HEAD lookup's 2xx means (a HEAD answer has no body, so no status to read): "succeeded" only
    # where the provider's object under the key exists once the effect is done; "unknown" (the
    # default): found, its state unknown (accepted, looked up again, then a person).
    exists_means: Literal["succeeded", "unknown"] | None = None

    @property
    def by_key(self) -> bool:
        """Whether it asks by the key the provider saw: its request names ``{idempotency_key}``. The one
        definition (the loader, provider_fencing, the probe, interpret_lookup): a ``key_field`` alone
        does not make a lookup by key, since the provider is not asked for the key's objects."""
        return KEY_PLACEHOLDER in self.request.placeholder_names()

    @model_validator(mode="after")
    def _reads_and_verifies(self) -> LookupSpec:
        method = self.request.method
        if method in ("PUT", "PATCH", "DELETE"):
            raise ValueError(
                f"lookup.request.method {method} acts on the provider, and a lookup only reads: use GET or "
                "HEAD (or a POST search with lookup.search: true)"
            )
        if method == "POST" and not self.search:
            raise ValueError(
                "lookup.request.method POST is a write unless declared otherwise: if this endpoint only "
                "searches, add lookup.search: true; otherwise use GET or HEAD"
            )
        if self.search and method != "POST":
            raise ValueError(f"lookup.search: true declares a POST search; this lookup is a {method}")
        if method == "HEAD" and not self.by_key:
            raise ValueError(
                "a HEAD lookup has no body, so nothing tells our object from another one: it must ask by the "
                "key ({idempotency_key} in lookup.request); a lookup by reference is a GET with lookup.match"
            )
        if self.exists_means is not None and method != "HEAD":
            raise ValueError(
                f"lookup.exists_means applies to a HEAD lookup (a {method} answer's {self.status_field} says the "
                "state): remove it"
            )
        if self.match:
            problem = match_problem(self.match)
            if problem:
                raise ValueError(f"lookup.match: {problem}")
            if method == "HEAD":
                raise ValueError("lookup.match: a HEAD answer has no body to compare; use GET")
        elif not self.by_key:
            raise ValueError(
                "this lookup is not by the provider's key (no {idempotency_key} in lookup.request; a "
                "lookup.key_field alone does not make it one), so it can find others' objects too (an earlier "
                "refund of the same order): add lookup.match with the fields that make an object ours, e.g. "
                'match: {amount: "{amount}", order_id: "{order_id}"}'
            )
        return self


class ListSpec(_Strict):
    """A listing of recent effects at the provider, for the reconciliation report."""

    request: RequestSpec
    items_field: str = "data"
    # Cursor pagination, two common shapes: the response names the next cursor
    # (next_cursor_field), or the cursor is a field of the last item (Stripe's starting_after).
    cursor_param: str | None = None
    next_cursor_field: str | None = None
    cursor_from_last_item: str | None = None
    has_more_field: str | None = None
    page_size_param: str | None = None
    page_size: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _cursor_source(self) -> ListSpec:
        if self.cursor_param and not (self.next_cursor_field or self.cursor_from_last_item):
            raise ValueError("cursor_param needs next_cursor_field or cursor_from_last_item")
        return self


class BudgetSpec(_Strict):
    max_attempts: int = Field(default=5, gt=0)
    deadline_s: float = Field(default=3600.0, gt=0)
    base_delay_s: float = Field(default=0.5, gt=0)
    max_delay_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> BudgetSpec:
        if self.base_delay_s > self.max_delay_s:
            raise ValueError(f"base_delay_s ({self.base_delay_s}) must be <= max_delay_s ({self.max_delay_s})")
        return self


class ApprovalSpec(_Strict):
    """When an intent of the action waits for a person, and what the person's approval covers."""

    required: Literal["always", "when", "never"] = "never"
    # With required: when: a safe expression over the arguments (outbox/actions/conditions.py).
    when: str | None = None
    ttl_s: float = Field(default=3600.0, gt=0)
    policy_version: str = Field(default="1", min_length=1, max_length=64)
    separate_approver: bool = True

    @model_validator(mode="after")
    def _condition(self) -> ApprovalSpec:
        from outbox.actions.conditions import parse_condition

        if self.required == "when":
            if not self.when:
                raise ValueError('required: when needs a `when:` expression (e.g. "amount > 500")')
            parse_condition(self.when)
        elif self.when is not None:
            raise ValueError(f"`when:` applies only with required: when (required is {self.required!r})")
        return self

    def applies(self, args: dict[str, Any]) -> bool:
        """Whether an intent with these arguments needs a person's approval."""
        if self.required == "always":
            return True
        if self.required == "never" or self.when is None:
            return False
        from outbox.actions.conditions import evaluate, parse_condition

        return evaluate(parse_condition(self.when), args)


def irreversible_problem(irreversible: Any, approval: ApprovalSpec) -> str | None:
    """Why an action marked irreversible may not be declared so (None: it may). Automation never undoes
    its effect, so a person (or a condition the operator wrote) must decide before it is sent: an
    approval rule, ``always`` or ``when``. ``required: never`` is no rule: it says nobody looks."""
    if irreversible is not True or approval.required != "never":
        return None
    return (
        "irreversible: true needs an approval rule (automation never undoes its effect, so it is not sent on the "
        "agent's word alone): add approval: {required: always}, or approval: {required: when, when: "
        '"amount > 500"} for the cases a person must see; or drop irreversible: true if the effect can be undone'
    )


class EvidenceSpec(_Strict):
    """What an action asks of the evidence store (``OUTBOX_EVIDENCE_URL``, outbox/evidence/sinks.py).

    ``required``: fail closed. While a separate evidence store is down nothing of the action is sent:
    the operation waits (``waiting_for = evidence``, no attempt spent) and leaves once the store is
    back, so no effect of it is ever committed without its record. Without it (the default) the effect
    is sent and, if the store is down at that moment, recorded ``committed_evidence_degraded`` and
    backfilled. The ledger's own evidence table (no ``OUTBOX_EVIDENCE_URL``) is written in the same
    transaction as the success and is never down on its own: nothing waits there."""

    required: bool = False


class ToolSpec(_Strict):
    """How an agent runtime sees the action as a tool (producer/agents/): what it is for, its input
    schema, and which arguments are the business reference its key is made of."""

    description: str | None = Field(default=None, max_length=2000)
    # JSON Schema of the arguments (type: object). Default: one property per declared `args` name.
    args_schema: dict[str, Any] | None = None
    # Arguments that name the business object (an order id, a refund number): the key of a tool call
    # is {scope}:{action}:{their values}, so two calls about one object are one operation whatever
    # else the model wrote; without them, the key is made of the canonical arguments' digest.
    reference_args: list[str] = Field(default_factory=list)
    # Whether its effect destroys or overwrites something (MCP's destructiveHint: a host asks first).
    # True unless declared otherwise: a write the file does not describe is treated as destructive.
    destructive: bool = True

    @field_validator("args_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "object":
            raise ValueError('must be a JSON Schema with "type": "object"')
        return value

    def secret_references(self, sensitive_args: Iterable[str]) -> str | None:
        """Why these references cannot be (None: they can): a tool call's key is written out of their
        values (producer/agents/calls.py), and keys are shown unmasked everywhere and sent to the provider."""
        secret = {top_field(path) for path in sensitive_args}
        exposed = [ref for ref in self.reference_args if ref in secret]
        if not exposed:
            return None
        return (
            f"{exposed} are sensitive (sensitive_args): a tool call's idempotency key is made of these values "
            "and is shown in every output and sent to the provider; name a reference that is not secret, or "
            "none (the key is then a digest of the arguments)"
        )


class AmountCapSpec(_Strict):
    """``max_amount`` of a budget scope: the sum of the action's amount argument, at most ``limit``
    (in the argument's own unit: cents for ``amount_cents``). ``decimals`` and ``currency`` only say how
    the model is told it: ``{arg: amount_cents, limit: 50000, decimals: 2, currency: EUR}`` reads
    "500.00 EUR"."""

    arg: str = Field(min_length=1)
    limit: Decimal = Field(gt=0)
    currency: str | None = Field(default=None, min_length=1, max_length=8)
    decimals: int = Field(default=0, ge=0, le=6)

    @field_validator("arg")
    @classmethod
    def _plain(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError("must be a top-level argument name (e.g. amount_cents)")
        return value

    def cap(self) -> AmountCap:
        return AmountCap(self.arg, self.limit, self.currency, self.decimals)


class BudgetScopeSpec(_Strict):
    """What one conversation (budget scope) may spend: at the top of the file for every tool call, in an
    action for that action's calls (outbox/ledger/budget_scopes.py)."""

    max_calls: int | None = Field(default=None, gt=0)
    max_amount: AmountCapSpec | None = None
    # Attempts beyond each call's first, summed over the conversation's operations.
    max_retry_billed: int | None = Field(default=None, ge=0)
    # From the conversation's first call: later calls are refused.
    deadline_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _something(self) -> BudgetScopeSpec:
        if all(v is None for v in (self.max_calls, self.max_amount, self.max_retry_billed, self.deadline_s)):
            raise ValueError("declare at least one of max_calls, max_amount, max_retry_billed, deadline_s")
        return self

    def limit(self, bucket: str) -> ScopeLimit:
        return ScopeLimit(
            bucket,
            self.max_calls,
            self.max_amount.cap() if self.max_amount is not None else None,
            self.max_retry_billed,
            self.deadline_s,
        )


def every_tool_budget(value: BudgetScopeSpec | None) -> BudgetScopeSpec | None:
    """The file's top-level budget_scope (every tool call of a conversation): no amount there."""
    if value is not None and value.max_amount is not None:
        raise ValueError("max_amount belongs in an action's budget_scope: an amount is one action's argument")
    return value


def scope_limits(action: str, every: BudgetScopeSpec | None, own: BudgetScopeSpec | None) -> tuple[ScopeLimit, ...]:
    """The limits of an action's budgets in a scope: every tool call's (the file's top-level budget_scope),
    then its own."""
    return tuple(spec.limit(bucket) for bucket, spec in ((EVERY_TOOL, every), (action, own)) if spec is not None)


class AgentRulesSpec(_Strict):
    """What an action asks of agents' calls beyond one intent: the business object it touches, and what
    one conversation may spend on it (the actions file's ``object``, ``when_object_busy``, ``budget_scope``)."""

    # The business object it touches, as a template of its arguments ("order:{order_id}"): while an
    # operation on it is in doubt or awaits approval, a new one waits or is refused (outbox/ledger/objects.py).
    # YAML key `object` (alias: a field named `object` would shadow the builtin in this class).
    business_object: str | None = Field(default=None, alias="object")
    when_object_busy: Literal["wait", "refuse"] = "wait"
    # What one conversation may spend on this action's calls (outbox/ledger/budget_scopes.py).
    budget_scope: BudgetScopeSpec | None = None

    @field_validator("business_object")
    @classmethod
    def _object_template(cls, value: str | None) -> str | None:
        if value is not None:
            template_fields(value)  # raises on a malformed template or one without an argument
        return value

    @model_validator(mode="after")
    def _declared_in_args(self) -> AgentRulesSpec:
        declared = getattr(self, "args", None)  # the action's declared argument names (ActionConfig.args)
        if declared is None:
            return self
        if self.business_object is not None and (missing := template_fields(self.business_object) - set(declared)):
            raise ValueError(f"object {self.business_object!r} names {sorted(missing)}, not in args {declared}")
        cap = self.budget_scope.max_amount if self.budget_scope is not None else None
        if cap is not None and cap.arg not in declared:
            raise ValueError(f"budget_scope.max_amount.arg {cap.arg!r} is not in args {declared}")
        return self

    @property
    def object_rule(self) -> ObjectRule | None:
        return None if self.business_object is None else ObjectRule(self.business_object, self.when_object_busy)
