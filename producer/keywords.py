"""The keyword form of submit, for people: ``producer.submit(session, tenant=..., action=..., ...)``.

The ledger takes one ``Intent`` (outbox/ledger/intent.py): ``outbox.ledger.submit.submit(session,
intent)``. People script against keywords, so ``producer.submit`` (and ``Outbox.submit``,
``AsyncOutbox.submit``, ``submit_async``, ``producer.django.submit``) take either the intent's
fields as keywords, from which they build the ``Intent``, or an ``Intent`` built beforehand,
positionally; never both. ``rules`` (the loaded actions file) is a keyword of its own either
way: the ledger applies it at submit, it is not part of the intent.
"""

from __future__ import annotations

import warnings
from typing import Any, Required, TypedDict, Unpack, overload

from sqlalchemy.orm import Session

from outbox.ledger.intent import Intent
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.submit import Receipt
from outbox.ledger.submit import submit as submit_intent
from outbox.runs.lifecycle import RunReceipt
from outbox.runs.lifecycle import submit_run as submit_run_spec


class IntentFields(TypedDict, total=False):
    """An ``Intent``'s fields but the tenant, as keywords (the tenant is a keyword of its own: the
    ``Outbox`` clients default it)."""

    idempotency_key: Required[str]
    action: Required[str]
    args: Required[dict[str, Any]]
    subject: Required[str]
    run_id: str | None
    tool_call_id: str | None
    max_attempts: int | None
    deadline_s: float | None
    delay_s: float
    requires_approval: bool
    provider_key: str | None
    submitted_by: str | None
    key_space: str
    priority: int
    traceparent: str | None
    budget_scope: str | None


def former_rules(rules: SubmitRules | None, given: dict[str, Any]) -> SubmitRules | None:
    """``rules``, or the loaded actions file a caller passed under its former name ``key_rules=``
    (taken out of ``given``, with a DeprecationWarning); TypeError for both at once."""
    if "key_rules" not in given:
        return rules
    old = given.pop("key_rules")
    warnings.warn("key_rules= is now rules= (the same loaded actions file)", DeprecationWarning, stacklevel=3)
    if rules is not None:
        raise TypeError("pass the loaded actions file once, as rules= (key_rules= is its former name)")
    return old  # type: ignore[no-any-return]


def as_intent(intent: Intent | None, tenant: str | None, given: dict[str, Any]) -> Intent:
    """``intent`` as given, or the one its fields (``tenant`` and ``given``) build; TypeError for
    both at once or an unknown keyword; InvalidIntent, naming the field, for a bad value."""
    if intent is None:
        return Intent(tenant=tenant, **given)  # type: ignore[arg-type]  # no tenant: InvalidIntent names it
    if not isinstance(intent, Intent):
        raise TypeError(f"submit takes an Intent or keywords, not a {type(intent).__name__}")
    if given or tenant is not None:
        extra = sorted(given) + (["tenant"] if tenant is not None else [])
        raise TypeError(f"submit takes an Intent or its fields as keywords, not both (got {', '.join(extra)} too)")
    return intent


@overload
def submit(session: Session, intent: Intent, /, *, rules: SubmitRules | None = None) -> Receipt: ...


@overload
def submit(
    session: Session, /, *, tenant: str, rules: SubmitRules | None = None, **fields: Unpack[IntentFields]
) -> Receipt: ...


def submit(
    session: Session | None = None,
    intent: Intent | None = None,
    /,
    *,
    tenant: str | None = None,
    rules: SubmitRules | None = None,
    **fields: Any,
) -> Receipt:
    """Write one intent in the caller's transaction and return its receipt (never commits).

    ``submit(session, tenant=..., idempotency_key=..., action=..., args=..., subject=..., ...)``: the
    fields of ``Intent`` as keywords; or ``submit(session, intent)``. ``rules``: the loaded actions
    file (provider key templates, approval rules, objects, budgets); None: the default provider key
    ``{tenant}:{idempotency_key}`` and no rule. Raises ``InvalidIntent`` naming a bad field,
    ``IdempotencyConflict`` for a key used with other arguments; a replay returns the first receipt.
    """
    if session is None:  # submit(session=..., ...), as scripts called it before it took an Intent
        session = fields.pop("session", None)
        if session is None:
            raise TypeError("submit needs the caller's session: submit(session, ...)")
    rules = former_rules(rules, fields)
    return submit_intent(session, as_intent(intent, tenant, fields), rules=rules)


def submit_run(session: Session, /, **run: Any) -> RunReceipt:
    """``outbox.runs.lifecycle.submit_run`` in the caller's transaction (its keywords: tenant, run_key,
    steps, subject, budget, rules); ``key_rules=`` is taken as ``rules=``'s former name."""
    if "key_rules" in run:
        run["rules"] = former_rules(run.get("rules"), run)
    return submit_run_spec(session, **run)
