"""The actions file: targets (downstream systems) and actions (named capabilities) in YAML.

Operators add downstreams here without code (DESIGN.md, "Configuration"). The shape is a public
interface: models forbid unknown fields so a typo fails at load time, with a message that names
the file and the dotted path of the bad field, instead of silently using a default at 3 a.m.

``${VAR}`` (or ``${VAR:-default}``) in any string value is read from the environment at load
time, so secrets such as bearer tokens stay out of the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ValidationError

from outbox.actions.files import ActionsFileError, UnknownAction, read_yaml, resolve_env, unset_message
from outbox.actions.matching import match_arguments
from outbox.actions.specs import (
    BudgetScopeSpec,
    RequestSpec,
    _Strict,
    every_tool_budget,
    irreversible_problem,
    scope_limits,
)
from outbox.actions.versions import action_version
from outbox.errors import ConfigError
from outbox.ledger.budget_scopes import ScopeLimit
from outbox.ledger.objects import ObjectRule
from outbox.ledger.provider_keys import KeyRule
from outbox.privacy.masking import top_field
from workers.provider.action_config import ActionConfig as ActionConfig
from workers.provider.targets import TargetConfig as TargetConfig
from workers.provider.targets import TenantCredentials as TenantCredentials

ENV_VAR = "OUTBOX_ACTIONS_FILE"
# What an approved intent may still take after its deadline (OUTBOX_RECONCILE_MAX_LOOKUPS x _MAX_DELAY_S).
RECONCILE_WINDOW_S = 12 * 60.0

# Placeholders that are not arguments: the business key (lookups by key), and the list
# request's window start and page cursor (reconciliation report).
RESERVED_PLACEHOLDERS: frozenset[str] = frozenset({"idempotency_key"})
LIST_PLACEHOLDERS: frozenset[str] = frozenset({"since", "cursor"})


class ActionsFile(_Strict):
    targets: dict[str, TargetConfig]
    actions: dict[str, ActionConfig]
    # What one conversation may spend on every tool call together (an action's own budget_scope adds to it).
    budget_scope: Annotated[BudgetScopeSpec | None, AfterValidator(every_tool_budget)] = None

    def action(self, name: str) -> ActionConfig:
        try:
            return self.actions[name]
        except KeyError:
            raise UnknownAction(name, self.actions) from None

    def target_of(self, action: str | ActionConfig) -> TargetConfig:
        cfg = self.action(action) if isinstance(action, str) else action
        return self.targets[cfg.target]

    def key_retentions(self) -> list[tuple[str, float]]:
        """(action, provider_idempotency.retention_s) of every action whose provider keeps keys."""
        return [(n, a.provider_idempotency.retention_s) for n, a in self.actions.items() if a.provider_idempotency]

    def needs_approval(self, action: str, args: dict[str, Any]) -> bool:
        """Whether an intent of ``action`` with ``args`` waits for a person (False if unknown here)."""
        cfg = self.actions.get(action)
        return cfg is not None and cfg.approval.applies(args)

    def key_rule(self, action: str) -> KeyRule | None:
        """The action's provider key rule (outbox.ledger.provider_keys.SubmitRules); None if unknown here."""
        cfg = self.actions.get(action)
        return cfg.key_rule if cfg is not None else None

    def phase_of(self, action: str) -> Literal["draft", "commit"] | None:
        return self.actions[action].phase if action in self.actions else None

    def object_rule(self, action: str) -> ObjectRule | None:
        cfg = self.actions.get(action)
        return cfg.object_rule if cfg is not None else None

    def budgets_of(self, action: str) -> tuple[ScopeLimit, ...]:
        cfg = self.actions.get(action)
        return scope_limits(action, self.budget_scope, cfg.budget_scope if cfg is not None else None)

    def is_irreversible(self, action: str) -> bool:
        return action in self.actions and self.actions[action].irreversible

    def action_version(self, action: str) -> str | None:
        """The action's version (outbox/actions/versions.py); None for an action not in the file."""
        return self.versions.get(action)

    @cached_property
    def versions(self) -> dict[str, str]:
        """Every action's version, computed once: the worker reads it at every attempt."""
        out = {}
        for name, cfg in self.actions.items():
            target = self.targets.get(cfg.target)
            if target is not None:
                keys = cfg.provider_idempotency
                out[name] = action_version(
                    target=cfg.target,
                    base_url=target.base_url,
                    request=cfg.request,
                    decimal_args=cfg.decimal_args,
                    idempotency_header=keys.header if keys is not None else None,
                    connector=cfg.connector,
                )
        return out


def _check_references(cfg: ActionsFile, declared_targets: Mapping[str, bool]) -> list[tuple[str, str]]:
    """Cross-field checks pydantic cannot see from inside one model. ``cfg`` may hold only the parts
    that are valid on their own; ``declared_targets`` names every target the file declares, each with
    whether it declares per-tenant credentials (read from the file itself: a target left out of
    ``cfg``, say for a ``${VAR}`` not set where the file is checked, still says so)."""
    problems: list[tuple[str, str]] = []
    for name, action in cfg.actions.items():
        where = f"actions.{name}"
        if action.target not in declared_targets:
            problems.append(
                (f"{where}.target", f"unknown target {action.target!r}; known: {', '.join(sorted(declared_targets))}")
            )
        elif not action.key_rule.scoped_by_tenant and not declared_targets[action.target]:
            problems.append(
                (
                    f"{where}.provider_key",
                    f"{action.provider_key!r} has no {{tenant}}: two tenants with the same business key would "
                    f"share one key (one effect) at the provider; add {{tenant}}, or give each tenant its own "
                    f"credentials under targets.{action.target}.tenants",
                )
            )
        if action.webhooks is not None:
            problems += _webhook_problems(cfg, name, action)
        if irreversible := irreversible_problem(action.irreversible, action.approval):
            problems.append((f"{where}.approval", irreversible))
        window = action.approval_window_problem(RECONCILE_WINDOW_S)
        if window:
            problems.append((f"{where}.approval.ttl_s", window))
        if secret := action.tool.secret_references(action.sensitive_args):
            problems.append((f"{where}.tool.reference_args", secret))
        declared = set(action.args) if action.args is not None else None
        specs: list[tuple[str, RequestSpec, frozenset[str]]] = [("request", action.request, RESERVED_PLACEHOLDERS)]
        if action.lookup:
            specs.append(("lookup.request", action.lookup.request, RESERVED_PLACEHOLDERS))
        if action.listing:
            specs.append(("list.request", action.listing.request, RESERVED_PLACEHOLDERS | LIST_PLACEHOLDERS))
        for label, spec, reserved in specs:
            unknown = spec.placeholder_names() - reserved
            if not unknown:
                continue
            if declared is None:
                problems.append(
                    (f"{where}.{label}", f"placeholders {sorted(unknown)} need the action's `args:` list to check them")
                )
            elif unknown - declared:
                problems.append(
                    (
                        f"{where}.{label}.path",
                        f"placeholder(s) {sorted(unknown - declared)} are not argument names "
                        f"(args: {sorted(declared)}; reserved: {sorted(reserved)})",
                    )
                )
        if problem := _match_arguments_problem(action, declared):
            problems.append((f"{where}.lookup.match", problem))
        if declared is not None:
            for field in ("sensitive_args", "decimal_args"):
                missing = {top_field(path) for path in getattr(action, field)} - declared
                if missing:
                    problems.append((f"{where}.{field}", f"{sorted(missing)} are not in args {sorted(declared)}"))
    return problems


def _webhook_problems(cfg: ActionsFile, name: str, action: ActionConfig) -> list[tuple[str, str]]:
    """An action's ``webhooks``: its target must say how events are signed, and an event must have
    something to find the operation by."""
    assert action.webhooks is not None
    where = f"actions.{name}.webhooks"
    target = cfg.targets.get(action.target)
    problems = []
    if target is not None and target.webhooks is None:
        fix = f"add targets.{action.target}.webhooks"
        problems.append((where, f"target {action.target!r} declares no webhooks (scheme and secret): {fix}"))
    if action.webhooks.key is None and action.webhooks.reference_path(action.result_reference) is None:
        why = "where an event names its operation"
        problems.append((where, f"declare `key` or `reference` (or the action's result_reference): {why}"))
    unknown = match_arguments(action.webhooks.match) - RESERVED_PLACEHOLDERS
    declared = set(action.args) if action.args is not None else None
    if unknown and declared is None:
        problems.append(
            (f"{where}.match", f"placeholders {sorted(unknown)} need the action's `args:` list to check them")
        )
    elif unknown and declared is not None and unknown - declared:
        problems.append(
            (f"{where}.match", f"{sorted(unknown - declared)} are not argument names (args: {sorted(declared)})")
        )
    return problems


def _match_arguments_problem(action: ActionConfig, declared: set[str] | None) -> str | None:
    """Why lookup.match compares something the intent does not have (None: it compares arguments)."""
    if action.lookup is None or not action.lookup.match:
        return None
    unknown = match_arguments(action.lookup.match) - RESERVED_PLACEHOLDERS
    if not unknown:
        return None
    if declared is None:
        return f"placeholders {sorted(unknown)} need the action's `args:` list to check them"
    if unknown - declared:
        return f"{sorted(unknown - declared)} are not argument names (args: {sorted(declared)})"
    return None


@dataclass(frozen=True)
class ActionsReading:
    """Everything wrong with an actions file, not only the first thing."""

    config: ActionsFile | None  # None when there is any problem
    problems: list[tuple[str, str]]  # (dotted path, message), in the order of the file's checks
    unset: list[tuple[str, str]]  # (dotted path, VAR): ${VAR} references whose variable is not set
    declared: tuple[int, int] = (0, 0)  # actions, targets the file declares (valid or not)


def _message(error: Any) -> str:
    # Only the message, never the input: the value may be a resolved secret.
    msg = str(error["msg"])
    return msg.removeprefix("Value error, ")


def _valid_parts(resolved: dict[str, Any]) -> ActionsFile:
    """The targets and actions that are valid on their own, for the checks across them."""
    parts: dict[str, dict[str, Any]] = {"targets": {}, "actions": {}}
    for field, model in (("targets", TargetConfig), ("actions", ActionConfig)):
        raw = resolved.get(field)
        for name, part in raw.items() if isinstance(raw, dict) else ():
            try:
                parts[field][name] = model.model_validate(part)
            except ValidationError:
                pass  # reported by the whole file's validation
    return ActionsFile.model_construct(targets=parts["targets"], actions=parts["actions"])


def read_actions(data: Any, *, environ: Mapping[str, str] | None = None, strict: bool = True) -> ActionsReading:
    """Every problem of an already-parsed YAML tree, each with its dotted path. ``strict``: a ``${VAR}``
    whose variable is not set is a problem (as when workers start); otherwise it is only listed in
    ``unset`` and the fields that hold it are not checked (a file checked where secrets are absent)."""
    if not isinstance(data, dict):
        return ActionsReading(None, [("", "the file must be a mapping with `targets` and `actions`")], [])
    problems: list[tuple[str, str]] = []
    unset: list[tuple[str, str]] = []
    resolved = resolve_env(data, os.environ if environ is None else environ, "", problems, unset)
    if strict:
        problems += [(path, unset_message(name)) for path, name in unset]
    blank = {path for path, _ in unset}
    try:
        cfg = ActionsFile.model_validate(resolved)
    except ValidationError as exc:
        for e in exc.errors():
            path = ".".join(str(p) for p in e["loc"])
            if not any(path == b or path.startswith(b + ".") for b in blank):
                problems.append((path, _message(e)))
        cfg = _valid_parts(resolved)
    targets = resolved.get("targets")
    declared_targets = (
        {name: isinstance(t, dict) and _declares_accounts(t.get("tenants")) for name, t in targets.items()}
        if isinstance(targets, dict)
        else {}
    )
    problems += _check_references(cfg, declared_targets)
    actions = resolved.get("actions")
    declared = (len(actions) if isinstance(actions, dict) else 0, len(declared_targets))
    return ActionsReading(None if problems else cfg, problems, unset, declared)


def _declares_accounts(tenants: Any) -> bool:
    """Whether a target's ``tenants`` (as written) gives some tenant an account of its own: an entry
    with ``headers`` (an entry that only declares a limit lends none; targets.TenantCredentials)."""
    return isinstance(tenants, dict) and any(isinstance(t, dict) and "headers" in t for t in tenants.values())


def parse_actions(data: Any, *, source: str = "<actions>", environ: Mapping[str, str] | None = None) -> ActionsFile:
    """Validate an already-parsed YAML tree; ``source`` names it in error messages, with every problem."""
    reading = read_actions(data, environ=environ)
    if reading.config is None:
        raise ActionsFileError(source, reading.problems)
    return reading.config


def read_actions_file(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None, strict: bool = True
) -> ActionsReading:
    """Every problem of the file (``read_actions``), keys declared twice first."""
    data, twice = read_yaml(path)
    reading = read_actions(data, environ=environ, strict=strict)
    return replace(reading, config=None if twice else reading.config, problems=twice + reading.problems)


def load_actions(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> ActionsFile:
    """Read and validate the actions file; raises ActionsFileError naming the path and every bad field."""
    reading = read_actions_file(path, environ=environ)
    if reading.config is None:
        raise ActionsFileError(path, reading.problems)
    return reading.config


def load_actions_from_env(environ: Mapping[str, str] | None = None) -> ActionsFile:
    """Load the file named by OUTBOX_ACTIONS_FILE."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_VAR)
    if not path:
        raise ConfigError(f"{ENV_VAR} is not set; point it at an actions file (see examples/actions.yaml)")
    return load_actions(path, environ=env)
