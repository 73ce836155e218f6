"""The actions file: targets (downstream systems) and actions (named capabilities) in YAML.

Operators add downstreams here without code (DESIGN.md, "Configuration"). The shape is a public
interface: models forbid unknown fields so a typo fails at load time, with a message that names
the file and the dotted path of the bad field, instead of silently using a default at 3 a.m.

``${VAR}`` (or ``${VAR:-default}``) in any string value is read from the environment at load
time, so secrets such as bearer tokens stay out of the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from outbox.actions.files import ActionsFileError, UnknownAction, read_yaml, resolve_env, unset_message
from outbox.actions.specs import (
    AgentRulesSpec,
    ApprovalSpec,
    BudgetScopeSpec,
    BudgetSpec,
    ListSpec,
    LookupSpec,
    ProviderIdempotency,
    RequestSpec,
    ToolSpec,
    _Strict,
    every_tool_budget,
    scope_budgets,
)
from outbox.errors import ConfigError
from outbox.ledger.budget_scopes import ScopeBudget
from outbox.ledger.objects import ObjectRule
from outbox.ledger.provider_keys import DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, MIN_MAX_LENGTH, KeyRule, template_problem
from outbox.ledger.states import AttemptClass
from outbox.privacy.masking import Redactor, masked_view, path_problem, top_field
from workers.provider.targets import TargetConfig as TargetConfig
from workers.provider.targets import TenantCredentials as TenantCredentials

ENV_VAR = "OUTBOX_ACTIONS_FILE"
# What an approved intent may still take after its deadline (OUTBOX_RECONCILE_MAX_LOOKUPS x _MAX_DELAY_S).
RECONCILE_WINDOW_S = 12 * 60.0

# Placeholders that are not arguments: the business key (lookups by key), and the list
# request's window start and page cursor (reconciliation report).
RESERVED_PLACEHOLDERS: frozenset[str] = frozenset({"idempotency_key"})
LIST_PLACEHOLDERS: frozenset[str] = frozenset({"since", "cursor"})

# Classes a status code may be mapped to. not_sent and pending make no sense for a response:
# a response proves the request left.
MAPPABLE_CLASSES: frozenset[AttemptClass] = frozenset(
    {AttemptClass.NOT_PROCESSED, AttemptClass.REJECTED, AttemptClass.AMBIGUOUS, AttemptClass.SUCCEEDED}
)
_STATUS_KEY = re.compile(r"^[1-5](\d\d|xx)$")


class ActionConfig(AgentRulesSpec):
    target: str
    request: RequestSpec
    provider_idempotency: ProviderIdempotency | None = None
    fencing_header: str | None = None
    # The provider refuses, for a key, every request whose fencing token is older than the newest
    # it has seen for that key on any request, lookups included, checked when it commits. Then a
    # lookup that found nothing (carrying the reconciler's newer token) proves every earlier
    # attempt can no longer land, and an operation may end failed_before_commit after one. Without
    # it, an attempt that may still land (a frozen worker, a provider's queue) keeps that state out
    # of reach: when the budget ends, a person decides. Declare it only if the provider's docs say so.
    provider_fencing: bool = False
    on_ambiguous: Literal["lookup", "replay"] = "lookup"
    # The key the provider sees (outbox/ledger/provider_keys.py): rendered once at submit and stored, so
    # editing this never changes the key of an operation already submitted. Without {tenant}, two
    # tenants' equal business keys are one key at the provider: allowed only when the target gives
    # each tenant its own account (targets.<name>.tenants).
    provider_key: str = DEFAULT_TEMPLATE
    # The provider's limit on key length; a longer rendered key is sent as a SHA-256 of it.
    provider_key_max_length: int = Field(default=DEFAULT_MAX_LENGTH, ge=MIN_MAX_LENGTH, le=DEFAULT_MAX_LENGTH)
    lookup: LookupSpec | None = None
    # YAML key `list` (alias: a field named `list` would shadow the builtin in this class).
    listing: ListSpec | None = Field(default=None, alias="list")
    # Response field (dotted path allowed) kept as evidence. None: any JSON object 2xx counts.
    result_reference: str | None = "id"
    # Declared argument names; when given, placeholders and *_args are checked against them.
    args: list[str] | None = None
    # Dotted paths (customer.email, items[].card) masked in every output a person or tool reads;
    # their values are also redacted from whatever the provider answers (outbox/privacy/masking.py).
    sensitive_args: list[str] = Field(default_factory=list)
    # Paths of the provider's answers (a success's body, a found object) masked before they are stored.
    sensitive_response_fields: list[str] = Field(default_factory=list)
    decimal_args: list[str] = Field(default_factory=list)
    # Per-action override of the failure table: {409: ambiguous, "5xx": ambiguous}.
    status_map: dict[int | str, AttemptClass] = Field(default_factory=dict)
    connector: str | None = None
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    # A person's approval before anything is sent (outbox/approvals/decisions.py).
    approval: ApprovalSpec = Field(default_factory=ApprovalSpec)
    # Runs (outbox/runs/lifecycle.py): irreversible = never compensated; a draft is never real until its commit step.
    irreversible: bool = False
    phase: Literal["draft", "commit"] | None = None
    tool: ToolSpec = Field(default_factory=ToolSpec)  # as agent runtimes see it (producer/agents/)

    @field_validator("status_map")
    @classmethod
    def _status_keys(cls, value: dict[int | str, AttemptClass]) -> dict[int | str, AttemptClass]:
        out: dict[int | str, AttemptClass] = {}
        for key, klass in value.items():
            text = str(key).lower()
            if not _STATUS_KEY.match(text):
                raise ValueError(f"{key!r} is not a status code (100-599) or family like '5xx'")
            if klass not in MAPPABLE_CLASSES:
                raise ValueError(f"{key}: a response cannot be classed {klass.value!r}")
            out[text if text.endswith("xx") else int(text)] = klass
        return out

    @field_validator("sensitive_args", "sensitive_response_fields")
    @classmethod
    def _paths(cls, value: list[str]) -> list[str]:
        problems = [p for p in (path_problem(path) for path in value) if p]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    def approval_window_problem(self, reconcile_window_s: float) -> str | None:
        """Why an approved intent could outlive the provider's memory of its key (and so execute
        twice), given the reconciler's window; None when the approval wait fits."""
        keys = self.provider_idempotency
        if self.approval.required == "never" or keys is None:
            return None
        needed = self.approval.ttl_s + self.budget.deadline_s + reconcile_window_s
        if needed <= keys.retention_s:
            return None
        return (
            f"approval.ttl_s {self.approval.ttl_s:g} + budget.deadline_s {self.budget.deadline_s:g} "
            f"+ reconcile window {reconcile_window_s:g} = {needed:g}s exceeds provider_idempotency.retention_s "
            f"{keys.retention_s:g}: the provider could forget the key before the intent is settled"
        )

    def redactor(self, args: Any) -> Redactor:
        """Redacts this intent's sensitive argument values wherever the provider echoes them."""
        return Redactor.of(args, self.sensitive_args)

    def masked_args(self, args: Any) -> Any:
        """The arguments as people see them: sensitive paths masked, and their values redacted
        wherever else they appear (a card number repeated in a free-text field)."""
        return masked_view(args, self.sensitive_args, self.redactor(args))

    def masked_response(self, body: Any, redactor: Redactor | None = None) -> Any:
        return masked_view(body, self.sensitive_response_fields, redactor)

    @field_validator("provider_key")
    @classmethod
    def _key_template(cls, value: str) -> str:
        problem = template_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def key_rule(self) -> KeyRule:
        return KeyRule(self.provider_key, self.provider_key_max_length)

    @field_validator("connector")
    @classmethod
    def _connector_ref(cls, value: str | None) -> str | None:
        if value is not None and value.count(":") > 1:
            raise ValueError("use 'module:callable' or a registered connector name")
        return value

    @model_validator(mode="after")
    def _fencing_needs_header(self) -> ActionConfig:
        if self.provider_fencing and self.fencing_header is None:
            raise ValueError("provider_fencing: true needs fencing_header (the header that carries the token)")
        return self

    @model_validator(mode="after")
    def _replay_needs_keys(self) -> ActionConfig:
        # Replaying an ambiguous request is only safe if the provider deduplicates by our key.
        if self.on_ambiguous == "replay" and self.provider_idempotency is None:
            raise ValueError("on_ambiguous: replay requires provider_idempotency")
        # A lookup by our key can only find what carried our key: if the key is never sent, its
        # 404 is no proof of "never executed", and re-dispatching on it makes a second effect.
        if (
            self.lookup is not None
            and self.lookup.authoritative_not_found
            and self.provider_idempotency is None
            and "idempotency_key" in self.lookup.request.placeholder_names()
        ):
            raise ValueError(
                "lookup.authoritative_not_found: a lookup by {idempotency_key} proves nothing when the key "
                "is never sent; declare provider_idempotency (the header that carries it) or set "
                "authoritative_not_found: false"
            )
        return self


class ActionsConfig(_Strict):
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
        """The action's provider key rule (outbox.ledger.provider_keys.KeyRules); None if unknown here."""
        cfg = self.actions.get(action)
        return cfg.key_rule if cfg is not None else None

    def phase_of(self, action: str) -> Literal["draft", "commit"] | None:
        return self.actions[action].phase if action in self.actions else None

    def object_rule(self, action: str) -> ObjectRule | None:
        cfg = self.actions.get(action)
        return cfg.object_rule if cfg is not None else None

    def budgets_of(self, action: str) -> tuple[ScopeBudget, ...]:
        cfg = self.actions.get(action)
        return scope_budgets(action, self.budget_scope, cfg.budget_scope if cfg is not None else None)

    def is_irreversible(self, action: str) -> bool:
        return action in self.actions and self.actions[action].irreversible


def _check_references(cfg: ActionsConfig, declared_targets: Mapping[str, bool]) -> list[tuple[str, str]]:
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
        if declared is not None:
            for field in ("sensitive_args", "decimal_args"):
                missing = {top_field(path) for path in getattr(action, field)} - declared
                if missing:
                    problems.append((f"{where}.{field}", f"{sorted(missing)} are not in args {sorted(declared)}"))
    return problems


@dataclass(frozen=True)
class ActionsReading:
    """Everything wrong with an actions file, not only the first thing."""

    config: ActionsConfig | None  # None when there is any problem
    problems: list[tuple[str, str]]  # (dotted path, message), in the order of the file's checks
    unset: list[tuple[str, str]]  # (dotted path, VAR): ${VAR} references whose variable is not set
    declared: tuple[int, int] = (0, 0)  # actions, targets the file declares (valid or not)


def _message(error: Any) -> str:
    # Only the message, never the input: the value may be a resolved secret.
    msg = str(error["msg"])
    return msg.removeprefix("Value error, ")


def _valid_parts(resolved: dict[str, Any]) -> ActionsConfig:
    """The targets and actions that are valid on their own, for the checks across them."""
    parts: dict[str, dict[str, Any]] = {"targets": {}, "actions": {}}
    for field, model in (("targets", TargetConfig), ("actions", ActionConfig)):
        raw = resolved.get(field)
        for name, part in raw.items() if isinstance(raw, dict) else ():
            try:
                parts[field][name] = model.model_validate(part)
            except ValidationError:
                pass  # reported by the whole file's validation
    return ActionsConfig.model_construct(targets=parts["targets"], actions=parts["actions"])


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
        cfg = ActionsConfig.model_validate(resolved)
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


def parse_actions(data: Any, *, source: str = "<actions>", environ: Mapping[str, str] | None = None) -> ActionsConfig:
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


def load_actions(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> ActionsConfig:
    """Read and validate the actions file; raises ActionsFileError naming the path and every bad field."""
    reading = read_actions_file(path, environ=environ)
    if reading.config is None:
        raise ActionsFileError(path, reading.problems)
    return reading.config


def load_actions_from_env(environ: Mapping[str, str] | None = None) -> ActionsConfig:
    """Load the file named by OUTBOX_ACTIONS_FILE."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_VAR)
    if not path:
        raise ConfigError(f"{ENV_VAR} is not set; point it at an actions file (see examples/actions.yaml)")
    return load_actions(path, environ=env)
