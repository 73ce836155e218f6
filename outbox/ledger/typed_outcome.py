"""The typed outcome: one word and one sentence a language model can act on, for every state.

The same vocabulary in every agent-facing surface (HTTP API, MCP, SDK helpers, console; DESIGN.md,
"Surfaces"): ``outcome`` says what happened in terms of what the model may do next, and
``model_message`` says it in one sentence, with the provider's reference or the reason.
"""

from __future__ import annotations

import enum
from typing import Any

from outbox.ledger.states import Status, WaitingFor


class Outcome(str, enum.Enum):
    SUCCEEDED = "SUCCEEDED"
    FAILED_BEFORE_COMMIT = "FAILED_BEFORE_COMMIT"
    FAILED_AT_PROVIDER = "FAILED_AT_PROVIDER"
    UNKNOWN = "UNKNOWN"
    NEEDS_HUMAN = "NEEDS_HUMAN"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    PENDING = "PENDING"
    CANCELLED = "CANCELLED"
    # A person closed its case without knowing whether it happened (abandoned, or retried as a new intent).
    ABANDONED = "ABANDONED"
    # Not stored: a rule of the actions file refused the call at submit (a conversation's budget, a busy
    # business object). Never an operation's state; only an answer to a call.
    REFUSED = "REFUSED"


OUTCOME_OF: dict[Status, Outcome] = {
    Status.SUCCEEDED: Outcome.SUCCEEDED,
    Status.COMMITTED_EVIDENCE_DEGRADED: Outcome.SUCCEEDED,
    Status.FAILED_BEFORE_COMMIT: Outcome.FAILED_BEFORE_COMMIT,
    Status.OUTCOME_UNKNOWN: Outcome.UNKNOWN,
    Status.RECONCILIATION_REQUIRED: Outcome.NEEDS_HUMAN,
    Status.AWAITING_APPROVAL: Outcome.AWAITING_APPROVAL,
    Status.NOT_DISPATCHED: Outcome.PENDING,
    Status.DISPATCHING: Outcome.PENDING,
    Status.CANCELLED: Outcome.CANCELLED,
    Status.ACCEPTED: Outcome.PENDING,
    Status.FAILED_AT_PROVIDER: Outcome.FAILED_AT_PROVIDER,
    Status.ABANDONED: Outcome.ABANDONED,
}
# Outcomes a waiting caller stops waiting at: final, or waiting for a person.
SETTLED: frozenset[Outcome] = frozenset(set(Outcome) - {Outcome.PENDING, Outcome.UNKNOWN})


# What a caller may do after a final "did not happen": the same intent answers the same outcome.
# Agent tools say how to try again in their own terms (producer/agents/calls.py: retry_of).
_AGAIN = "Retrying the same intent will not change that; a changed intent needs a new idempotency key."


def outcome_of(status: str | Status) -> Outcome:
    return OUTCOME_OF[Status(status)]


def model_message(op: dict[str, Any], *, again: str = _AGAIN) -> str:
    """One sentence for the model, from an operation's JSON (outbox/queries.operation_json).
    ``again``: what a caller may do after a final "did not happen" (a surface's own way to retry)."""
    outcome = outcome_of(op["status"])
    action = op.get("action") or "the action"
    if outcome is Outcome.SUCCEEDED:
        ref = (op.get("result") or {}).get("reference")
        return f"Already done: {action} succeeded" + (f" (reference {ref})" if ref else "") + "; do not retry."
    if outcome is Outcome.FAILED_BEFORE_COMMIT:
        why = op.get("reason") or op.get("last_error") or "no reason recorded"
        return f"Not executed: {action} did not happen ({why}). {again}"
    if outcome is Outcome.FAILED_AT_PROVIDER:
        why = op.get("reason") or op.get("last_error") or "no reason recorded"
        return (
            f"Failed at the provider: {action} was accepted and then failed there ({why}); it did not take "
            f"effect. {again}"
        )
    if outcome is Outcome.UNKNOWN:
        return (
            f"Outcome unknown: the provider may have executed {action}; do not retry, it is being checked "
            "with the provider."
        )
    if outcome is Outcome.NEEDS_HUMAN:
        return _with_a_person(op, action)
    if outcome is Outcome.AWAITING_APPROVAL:
        return f"{action} is waiting for a person's approval; nothing has been sent. Wait, or check later."
    if outcome is Outcome.CANCELLED:
        return f"Cancelled: {action} was cancelled before anything was sent; it did not happen."
    if outcome is Outcome.ABANDONED:
        instead = (
            f" A person retried it as a new intent (operation {op['retried_as']})." if op.get("retried_as") else ""
        )
        return (
            f"Abandoned: a person stopped checking whether {action} happened; it may or may not have taken effect."
            f"{instead} Do not retry it, and do not tell the user it happened or failed: say a person handled it."
        )
    if op.get("status") == Status.ACCEPTED.value:
        ref = (op.get("result") or {}).get("reference")
        return (
            f"Accepted, not finished: the provider took {action}"
            + (f" (reference {ref})" if ref else "")
            + " and is still processing it; it is being checked with the provider. Do not resubmit; wait for "
            "it or check later."
        )
    if op.get("waiting_for") == WaitingFor.EVIDENCE.value:
        return (
            f"Waiting, nothing sent: {action} is sent only while its audit record can be kept, and the evidence "
            "store is down; it is sent once the store is back. Wait for it or check later, do not resubmit."
        )
    if op.get("waiting_for") == WaitingFor.STOPPED.value:
        return (
            f"On hold, nothing sent: an operator stopped this agent, so {action} is held until they resume it. "
            "Do not retry or resubmit; tell the user it is on hold."
        )
    if op.get("waiting_for") == "object":
        why = op.get("reason") or "another operation on the same object is not settled"
        return (
            f"Waiting, nothing sent: {action} is held back ({why}); it is sent once that outcome is known. Wait for "
            "it or check later, do not resubmit."
        )
    return f"Accepted, not finished: {action} is queued or in progress; wait for it or check later, do not resubmit."


def _with_a_person(op: dict[str, Any], action: str) -> str:
    """NEEDS_HUMAN, by what the person is asked for (``waiting_for``)."""
    why = op.get("reason") or op.get("last_error") or "no reason recorded"
    if op.get("waiting_for") == WaitingFor.CREDENTIALS.value:
        return (
            f"Not executed yet: the provider refused our credentials for {action}, so nothing happened. A person "
            "must fix the credentials; then it is sent again under the same idempotency key. Do not retry or "
            "resubmit, and do not tell the user it failed: wait for it or check later."
        )
    if op.get("waiting_for") == WaitingFor.AUTHORITY.value:
        return (
            f"Not executed: the key that submitted {action} was revoked, so nothing was sent; a person decides "
            "whether it goes ahead. Do not retry or resubmit: wait for the decision or check later."
        )
    if op.get("waiting_for") == WaitingFor.DECISION.value:
        return (
            f"Not executed: {action} did not happen ({why}); instead of failing it, a person decides whether to "
            "send it again or drop it. Do not retry or resubmit: wait for the decision or check later."
        )
    return f"A person is deciding whether {action} happened; do not retry, and do not tell the user it failed."


def with_outcome(op: dict[str, Any]) -> dict[str, Any]:
    """The operation's JSON plus ``outcome`` and ``model_message``."""
    return op | {"outcome": outcome_of(op["status"]).value, "model_message": model_message(op)}
