"""What the HTTP API answers, as typed values: the JSON members under their own names.

Every model keeps members it does not declare (``extra="allow"``: ``model_extra``), so a newer
server may add fields without breaking an older client; optional members default to None. Numbers
in answers are read as exact decimals (an amount in a provider's response stays what it was).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from outbox.ledger.typed_outcome import SETTLED, Outcome

# Outcomes a waiting caller keeps waiting at. Any other, even one this client does not know yet,
# ends a wait: the caller reads it.
UNSETTLED: frozenset[str] = frozenset(o.value for o in Outcome if o not in SETTLED)


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class Operation(_Answer):
    """An operation as ``GET /v1/operations/{id}`` answers it (``agent-outbox ops show --json`` plus
    ``outcome`` and ``model_message``). A listing's rows lack ``attempt_log``, ``history``,
    ``approval`` and ``timing`` (None there)."""

    operation_id: str
    tenant: str
    idempotency_key: str
    provider_key: str
    action: str
    status: str
    outcome: str
    model_message: str
    # With PENDING: QUEUED (nothing sent yet), IN_PROGRESS or ACCEPTED (by the provider, not finished).
    stage: str | None = None
    subject: str | None = None
    submitted_by: str | None = None
    waiting_for: str | None = None
    reason: str | None = None
    attempts: int | None = None
    max_attempts: int | None = None
    priority: int | None = None
    fencing_token: int | None = None
    result: dict[str, Any] | None = None
    error_class: str | None = None
    last_error: str | None = None
    cancel_requested: bool | None = None
    args_digest: str | None = None
    # The action's version at submit; the request its key names ({version, method, digest}).
    action_version: str | None = None
    request: dict[str, Any] | None = None
    run_id: str | None = None
    tool_call_id: str | None = None
    object: str | None = None  # the business object it touches (outbox/ledger/objects.py)
    budget_scope: str | None = None  # the conversation charged for it
    # On a submit with a budget scope: what is left ({"left": "...", "budgets": [...]}); a busy object.
    budget: dict[str, Any] | None = None
    waiting_on: dict[str, Any] | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    next_attempt_at: datetime | None = None
    deadline_at: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    attempt_log: list[dict[str, Any]] | None = None
    history: list[dict[str, Any]] | None = None
    approval: dict[str, Any] | None = None
    timing: dict[str, Any] | None = None

    _new: bool | None = PrivateAttr(default=None)

    @property
    def settled(self) -> bool:
        """Final, or waiting for a person or an approval: waiting longer will not change it by itself."""
        return self.outcome not in UNSETTLED

    @property
    def reference(self) -> str | None:
        """The provider's reference of a success."""
        ref = (self.result or {}).get("reference")
        return ref if isinstance(ref, str) else None

    @property
    def new(self) -> bool | None:
        """From a submit: True if this submit stored the intent (201), False if the same intent was
        already there (200, a replay); None for an operation read any other way."""
        return self._new


class Page(_Answer):
    """One page of ``GET /v1/operations``, newest first; ``next_cursor`` None on the last page."""

    operations: list[Operation]
    next_cursor: str | None = None


class BatchItem(_Answer):
    """One intent's answer in a batch: ``status`` 201/200 with ``operation``, or 409/422 with ``problem``."""

    index: int
    status: int
    operation: Operation | None = None
    problem: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.operation is not None


class Run(_Answer):
    """A run as ``GET /v1/runs/{id}`` answers it: its steps, what holds it, its budget, its outcome."""

    run_id: str
    run_key: str
    status: str
    steps: list[dict[str, Any]]
    outcome: str
    model_message: str
    tenant: str | None = None
    subject: str | None = None
    meaning: str | None = None
    reason: str | None = None
    holding: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None
    priority: int | None = None
    waiting_for_person: list[str] | None = None
    cancel_requested: bool | None = None
    compensate_requested: bool | None = None
    resolved_by: str | None = None
    note: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    history: list[Any] | None = None

    _new: bool | None = PrivateAttr(default=None)

    @property
    def new(self) -> bool | None:
        """From a submit: True if this submit stored the run (201), False if it was already there (200)."""
        return self._new


class PendingApproval(_Answer):
    """An operation awaiting approval, as ``GET /v1/approvals`` lists it (oldest first)."""

    operation_id: str
    tenant: str | None = None
    idempotency_key: str | None = None
    action: str | None = None
    subject: str | None = None
    reason: str | None = None
    args_digest: str | None = None
    waiting_since: datetime | None = None


class Approval(_Answer):
    """A decision (approve or deny), bound to the operation's arguments by ``args_digest``."""

    approval_id: int
    operation_id: str
    decision: str
    tenant: str | None = None
    action: str | None = None
    args_digest: str | None = None
    requested_by: str | None = None
    policy_version: str | None = None
    approver: str | None = None
    note: str | None = None
    decided_at: datetime | None = None
    expires_at: datetime | None = None


class Handoff(_Answer):
    """The packet a person needs to take over an operation automation could not settle.
    ``operation_status``: set by a resolve only (the operation's status after it)."""

    handoff_id: int
    operation_id: str
    status: str
    reason: str | None = None
    opened_at: datetime | None = None
    resolution: str | None = None
    resolved_reference: str | None = None
    resolved_by: str | None = None
    resolved_at: datetime | None = None
    note: str | None = None
    packet: dict[str, Any] | None = None
    operation_status: str | None = None
    # The case: who took it, when the provider is asked again and until when, what evidence resolved
    # it; the two ends of a retry as a new intent.
    owner: str | None = None
    taken_at: datetime | None = None
    next_check_at: datetime | None = None
    checks_until: datetime | None = None
    resolved_by_evidence: bool = False
    evidence_attempt_id: int | None = None
    retry_of: str | None = None
    retried_as: str | None = None
