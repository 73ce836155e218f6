"""The key the provider sees: the business idempotency key, scoped by tenant.

Two tenants may both submit ``refund-1``: in the ledger they are two intents (the unique key is
(tenant, idempotency_key)), so at the provider they must be two keys too, or the second tenant's
refund is answered with the first tenant's effect (same arguments) or refused (different ones).
The provider key is rendered once, at submit, from the action's ``provider_key`` template
(default ``{tenant}:{idempotency_key}``) and stored on the operation: every dispatch attempt and
every lookup sends that stored key, so a later edit of the actions file never changes the key of
an operation already submitted (a request that went out under the old key would otherwise be
invisible to lookups under the new one).

A rendered key longer than the provider's limit becomes ``h:`` + the SHA-256 of the rendered key
(hex, cut to the limit): still one key per (tenant, business key), still stable. The tenant is
rendered with ``%`` and ``:`` percent-escaped, so the separator cannot be forged by a tenant name
(``acme:eu`` + ``r1`` and ``acme`` + ``eu:r1`` are two keys).
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from outbox.ledger.budget_scopes import ScopeLimit
    from outbox.ledger.objects import ObjectRule

DEFAULT_TEMPLATE = "{tenant}:{idempotency_key}"
DEFAULT_MAX_LENGTH = 255  # the ledger's column; most providers allow 255 (Stripe) or fewer
MIN_MAX_LENGTH = 24  # "h:" + 22 hex digits: 88 bits of hash, still no collisions in practice
FIELDS = frozenset({"tenant", "idempotency_key", "action"})
HASH_PREFIX = "h:"


@dataclass(frozen=True)
class KeyRule:
    """How an action's provider key is made: a template over FIELDS and the provider's length limit."""

    template: str = DEFAULT_TEMPLATE
    max_length: int = DEFAULT_MAX_LENGTH

    def __post_init__(self) -> None:
        problem = template_problem(self.template)
        if problem:
            raise ValueError(problem)
        if not MIN_MAX_LENGTH <= self.max_length <= DEFAULT_MAX_LENGTH:
            raise ValueError(f"max length must be {MIN_MAX_LENGTH}-{DEFAULT_MAX_LENGTH}, got {self.max_length}")

    @property
    def scoped_by_tenant(self) -> bool:
        return "tenant" in template_fields(self.template)

    def render(self, *, tenant: str, idempotency_key: str, action: str) -> str:
        # The tenant is escaped (":" and "%"), so tenant "acme:eu" with key "r1" and tenant "acme"
        # with key "eu:r1" stay two keys; business keys are sent as they are.
        key = self.template.format(tenant=escape_tenant(tenant), idempotency_key=idempotency_key, action=action)
        if len(key) <= self.max_length:
            return key
        return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()[: self.max_length - len(HASH_PREFIX)]


class SubmitRules(Protocol):
    """What the actions file decides at submit (workers.provider.actions.ActionsFile): the action's
    provider key rule, and whether an intent waits for a person's approval."""

    def key_rule(self, action: str) -> KeyRule | None: ...

    def needs_approval(self, action: str, args: dict[str, Any]) -> bool: ...

    def object_rule(self, action: str) -> ObjectRule | None:
        """The business object the action touches (outbox/ledger/objects.py); None: none declared."""
        ...

    def budgets_of(self, action: str) -> tuple[ScopeLimit, ...]:
        """What one budget scope may spend on the action's calls (outbox/ledger/budget_scopes.py):
        the file's top-level budget_scope, then the action's own."""
        ...

    def action_version(self, action: str) -> str | None:
        """The version of the action's request-shaping definition (outbox/actions/versions.py), recorded
        on the operation at submit; None: not known here (the operation's first request records it)."""
        ...


def template_fields(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def template_problem(template: str) -> str | None:
    """Why ``template`` cannot be a provider key template, or None."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"malformed template {template!r}: {exc}"
    fields = {f for _, f, _, _ in parsed if f is not None}
    if any(spec or conv for _, f, spec, conv in parsed if f is not None):
        return f"placeholders in {template!r} take no format spec or conversion"
    if fields - FIELDS:
        return f"unknown placeholder(s) {sorted(fields - FIELDS)} in {template!r}; use {sorted(FIELDS)}"
    if "idempotency_key" not in fields:
        return f"{template!r} must contain {{idempotency_key}}: without it every intent would share one key"
    return None


def escape_tenant(tenant: str) -> str:
    return tenant.replace("%", "%25").replace(":", "%3A")


DEFAULT_RULE = KeyRule()


def rule_for(rules: SubmitRules | Mapping[str, KeyRule] | None, action: str) -> KeyRule:
    if rules is None:
        return DEFAULT_RULE
    found = rules.get(action) if isinstance(rules, Mapping) else rules.key_rule(action)
    return found or DEFAULT_RULE
