"""One action of the actions file: its target, request, provider contract, lookup, budget and rules.

The whole file (targets, actions, reading and cross-checks) is workers/provider/actions.py.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outbox.actions.specs import (
    AgentRulesSpec,
    ApprovalSpec,
    BudgetSpec,
    EvidenceSpec,
    ListSpec,
    LookupSpec,
    ProviderIdempotency,
    RequestSpec,
    ToolSpec,
)
from outbox.actions.webhooks import WebhookSpec
from outbox.ledger.provider_keys import DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, MIN_MAX_LENGTH, KeyRule, template_problem
from outbox.ledger.states import AttemptClass
from outbox.privacy.masking import Redactor, masked_view, path_problem

# Classes a status code may be mapped to. not_sent and pending make no sense for a response:
# a response proves the request left.
MAPPABLE_CLASSES: frozenset[AttemptClass] = frozenset(
    {AttemptClass.NOT_PROCESSED, AttemptClass.REJECTED, AttemptClass.AMBIGUOUS, AttemptClass.SUCCEEDED}
)
_STATUS_KEY = re.compile(r"^[1-5](\d\d|xx)$")


class ReportSpec(BaseModel):
    """What the reconciliation report needs to know of an action beyond its requests
    (outbox/reads/same_effect.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The arguments whose equal values make two operations the same business effect ("two refunds of
    # one order"): listed as possible duplicates when both succeeded under different keys. Without it,
    # the action's ``object`` template decides.
    same_effect_when: list[str] = Field(min_length=1)

    @field_validator("same_effect_when")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not name.isidentifier()]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an argument name (a top-level argument, such as order_id)")
        return value


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
    # Which of the target's webhook events settle its operations (outbox/actions/webhooks.py).
    webhooks: WebhookSpec | None = None
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
    # What an operation that would end failed_before_commit (a rejection, the budget spent while
    # nothing was executed) does instead: fail (the default), or go to a person (reconciliation_required,
    # waiting_for = decision, a handoff with the reason it would have failed).
    on_final_failure: Literal["fail", "handoff"] = "fail"
    # evidence: {required: true}: nothing is sent while the separate evidence store is down (EvidenceSpec).
    evidence: EvidenceSpec = Field(default_factory=EvidenceSpec)
    tool: ToolSpec = Field(default_factory=ToolSpec)  # as agent runtimes see it (producer/agents/)
    # report: {same_effect_when: [order_id]}: how the reconciliation report finds two effects on one object.
    report: ReportSpec | None = None

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
        if self.provider_fencing and self.lookup is not None and not self.lookup.by_key:
            # The provider fences per key: a lookup that does not name the key (a search by order) fences
            # nothing, and its "not found" would wrongly prove that no earlier attempt can still land.
            raise ValueError(
                "provider_fencing: true needs a lookup whose request names the key ({idempotency_key}): "
                "a search by business reference cannot fence it; set provider_fencing: false"
            )
        return self

    @model_validator(mode="after")
    def _same_effect_args_declared(self) -> ActionConfig:
        if self.report is not None and self.args is not None:
            missing = [a for a in self.report.same_effect_when if a not in self.args]
            if missing:
                raise ValueError(f"report.same_effect_when names {missing}, not in args {self.args}")
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
            and self.lookup.by_key
        ):
            raise ValueError(
                "lookup.authoritative_not_found: a lookup by {idempotency_key} proves nothing when the key "
                "is never sent; declare provider_idempotency (the header that carries it) or set "
                "authoritative_not_found: false"
            )
        return self
