"""What a producer needs of the actions file: each action's provider key rule and approval rule.

A producer (an agent service, ``agent-outbox submit``, the HTTP API) renders the provider key and
decides ``awaiting_approval`` at submit, and nothing more: it must not need the targets' secrets
(``${PAYMENTS_TOKEN}``) to do so, nor hold them. This reads only ``actions.<name>.provider_key``,
``provider_key_max_length``, ``approval``, ``phase``, ``irreversible``, ``tool``, ``args``,
``sensitive_args``, ``object``, ``when_object_busy``, ``budget_scope`` and the file's top-level
``budget_scope`` (``${VAR}`` resolved there only), checked as the full loader checks them; and, for
each action's version (outbox/actions/versions.py), its ``target``, ``request``, ``decimal_args``,
``provider_idempotency``, ``connector`` and its target's ``base_url`` (never the targets' headers);
workers load the whole file (workers/provider/actions.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from outbox.actions.files import ActionsFileError, read_yaml, resolve_env
from outbox.actions.specs import ApprovalSpec, BudgetScopeSpec, ToolSpec, irreversible_problem, scope_limits
from outbox.actions.versions import version_of_raw
from outbox.ledger.budget_scopes import ScopeLimit
from outbox.ledger.objects import ObjectRule, template_fields
from outbox.ledger.provider_keys import DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, KeyRule


@dataclass(frozen=True)
class ActionRules:
    """outbox.ledger.provider_keys.SubmitRules for the actions of one file."""

    keys: dict[str, KeyRule]
    approvals: dict[str, ApprovalSpec]
    # What a run records of each step's action at submit (outbox/runs/spec.py).
    phases: dict[str, Literal["draft", "commit"]] = field(default_factory=dict)
    irreversible: frozenset[str] = frozenset()
    # What agent runtimes see (producer/agents/): each action's tool spec and declared argument names.
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    declared_args: dict[str, list[str] | None] = field(default_factory=dict)
    objects: dict[str, ObjectRule] = field(default_factory=dict)  # outbox/ledger/objects.py
    budgets: dict[str, tuple[ScopeLimit, ...]] = field(default_factory=dict)  # outbox/ledger/budget_scopes.py
    # Each action's version (outbox/actions/versions.py); None: not known here (recorded by its first send).
    versions: dict[str, str | None] = field(default_factory=dict)

    @property
    def actions(self) -> dict[str, KeyRule]:
        return self.keys

    def key_rule(self, action: str) -> KeyRule | None:
        return self.keys.get(action)

    def needs_approval(self, action: str, args: dict[str, Any]) -> bool:
        spec = self.approvals.get(action)
        return spec is not None and spec.applies(args)

    def object_rule(self, action: str) -> ObjectRule | None:
        return self.objects.get(action)

    def budgets_of(self, action: str) -> tuple[ScopeLimit, ...]:
        return self.budgets.get(action, ())

    def phase_of(self, action: str) -> Literal["draft", "commit"] | None:
        return self.phases.get(action)

    def action_version(self, action: str) -> str | None:
        return self.versions.get(action)

    def is_irreversible(self, action: str) -> bool:
        return action in self.irreversible


def load_action_rules(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> ActionRules:
    data, _ = read_yaml(path)  # keys declared twice: the workers' loader refuses the file
    actions = data.get("actions") if isinstance(data, dict) else None
    if not isinstance(actions, dict):
        raise ActionsFileError(path, [("actions", "the file must be a mapping with `actions`")])
    env = os.environ if environ is None else environ
    problems: list[tuple[str, str]] = []
    raw_every = resolve_env(data.get("budget_scope"), env, "budget_scope", problems)
    every = _budget_scope(raw_every, "budget_scope", problems)
    if every is not None and every.max_amount is not None:
        problems.append(
            (
                "budget_scope.max_amount",
                "max_amount belongs in an action's budget_scope: an amount is one action's argument",
            )
        )
    objects: dict[str, ObjectRule] = {}
    budgets: dict[str, tuple[ScopeLimit, ...]] = {}
    keys: dict[str, KeyRule] = {}
    approvals: dict[str, ApprovalSpec] = {}
    phases: dict[str, Literal["draft", "commit"]] = {}
    irreversible: set[str] = set()
    tools: dict[str, ToolSpec] = {}
    args: dict[str, list[str] | None] = {}
    versions: dict[str, str | None] = {}
    for name, raw in actions.items():
        where = f"actions.{name}"
        if not isinstance(raw, dict):
            problems.append((where, "must be a mapping"))
            continue
        versions[name] = version_of_raw(raw, data.get("targets"), env)
        part = {
            k: raw[k]
            for k in (
                "provider_key",
                "provider_key_max_length",
                "approval",
                "phase",
                "irreversible",
                "tool",
                "args",
                "sensitive_args",
                "object",
                "when_object_busy",
                "budget_scope",
            )
            if k in raw
        }
        part = resolve_env(part, env, where, problems)
        try:
            keys[name] = KeyRule(
                part.get("provider_key", DEFAULT_TEMPLATE), int(part.get("provider_key_max_length", DEFAULT_MAX_LENGTH))
            )
        except (TypeError, ValueError) as exc:
            problems.append((f"{where}.provider_key", str(exc)))
        try:
            approvals[name] = ApprovalSpec.model_validate(part.get("approval") or {})
        except ValidationError as exc:
            problems.extend((f"{where}.approval." + ".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors())
        try:
            tools[name] = ToolSpec.model_validate(part.get("tool") or {})
        except ValidationError as exc:
            problems.extend((f"{where}.tool." + ".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors())
        else:
            sensitive = part.get("sensitive_args")
            if isinstance(sensitive, list) and (secret := tools[name].secret_references(map(str, sensitive))):
                problems.append((f"{where}.tool.reference_args", secret))
        declared = part.get("args")
        if declared is not None and not (isinstance(declared, list) and all(isinstance(a, str) for a in declared)):
            problems.append((f"{where}.args", "must be a list of argument names"))
        else:
            args[name] = declared
        if part.get("object") is not None:
            busy = part.get("when_object_busy", "wait")
            try:
                if busy not in ("wait", "refuse"):
                    raise ValueError("must be 'wait' or 'refuse'")
                fields = template_fields(str(part["object"]))
                if isinstance(declared, list) and (missing := fields - set(declared)):
                    raise ValueError(f"names {sorted(missing)}, not in args {declared}")
                objects[name] = ObjectRule(str(part["object"]), busy)
            except ValueError as exc:
                problems.append((f"{where}.object", str(exc)))
        own = _budget_scope(part.get("budget_scope"), f"{where}.budget_scope", problems)
        budgets[name] = scope_limits(name, every, own)
        phase = part.get("phase")
        if phase is not None and phase not in ("draft", "commit"):
            problems.append((f"{where}.phase", "must be 'draft' or 'commit' (or absent)"))
        elif phase is not None:
            phases[name] = phase
        if not isinstance(part.get("irreversible", False), bool):
            problems.append((f"{where}.irreversible", "must be true or false"))
        elif part.get("irreversible"):
            irreversible.add(name)
            if name in approvals and (unruled := irreversible_problem(True, approvals[name])):
                problems.append((f"{where}.approval", unruled))
    if problems:
        raise ActionsFileError(path, problems)
    return ActionRules(keys, approvals, phases, frozenset(irreversible), tools, args, objects, budgets, versions)


def _budget_scope(raw: Any, where: str, problems: list[tuple[str, str]]) -> BudgetScopeSpec | None:
    if raw is None:
        return None
    try:
        return BudgetScopeSpec.model_validate(raw)
    except ValidationError as exc:
        problems.extend((f"{where}." + ".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors())
        return None


_FORMER_NAMES = {"IntentRules": "ActionRules", "load_intent_rules": "load_action_rules"}


def __getattr__(name: str) -> Any:
    """The former names of ActionRules and load_action_rules, kept for scripts written against them."""
    if name in _FORMER_NAMES:
        import warnings

        warnings.warn(f"{name} is now {_FORMER_NAMES[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_FORMER_NAMES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
