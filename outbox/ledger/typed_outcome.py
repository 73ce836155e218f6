"""The typed outcome: one word and one sentence a language model can act on, for every state.

The same vocabulary in every agent-facing surface (HTTP API, MCP, SDK helpers, console; DESIGN.md,
"Surfaces"): ``outcome`` says what happened in terms of what the model may do next, and
``model_message`` says it in one sentence, with the provider's reference or the reason.

**Two words for two states under PENDING.** ``PENDING`` stays the one outcome of everything not
finished and not in doubt (clients wait on it: SETTLED, ``wait_operation``, every SDK's ``settled``),
and ``stage`` says which: ``QUEUED`` (nothing has left yet: it waits for a worker, its turn, a
breaker or a limit), ``IN_PROGRESS`` (a request is leaving, or one left and it is tried again under
the same key), ``ACCEPTED`` (the provider took it and has not finished it). A new outcome value would
have broken every client that knows PENDING; a field each old client ignores breaks none. ``stage``
is None for every other outcome. The sentence says the same: "Queued, not sent yet" is never
"Accepted, not finished".

**A result reads as its own.** A success reads "Done: ..." (the call's own result, a read, a task's
result); "Already done" only answers a call that found the operation an earlier call made (a replay:
``replay=True``), since a model reads it as "an earlier call did it".
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


class Stage(str, enum.Enum):
    """Where a PENDING operation is (the ``stage`` field; the module docstring says why a field)."""

    QUEUED = "QUEUED"  # nothing has left: waiting for a worker, its turn, a breaker or a limit
    IN_PROGRESS = "IN_PROGRESS"  # being sent, or sent and tried again under the same key
    ACCEPTED = "ACCEPTED"  # accepted by the provider, not finished


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


def stage_of(op: dict[str, Any]) -> Stage | None:
    """The stage of a PENDING operation's JSON (None for any other outcome). Nothing has left while no
    attempt counted (``attempts``: breaker and limit waits are refunded) and no request is on record."""
    status = Status(op["status"])
    if status is Status.ACCEPTED:
        return Stage.ACCEPTED
    if status is Status.DISPATCHING:
        return Stage.IN_PROGRESS
    if status is Status.NOT_DISPATCHED:
        left = bool(op.get("attempts")) or op.get("request") is not None
        return Stage.IN_PROGRESS if left else Stage.QUEUED
    return None


def model_message(op: dict[str, Any], *, again: str = _AGAIN, replay: bool = False) -> str:
    """One sentence for the model, from an operation's JSON (outbox/queries.operation_json).
    ``again``: what a caller may do after a final "did not happen" (a surface's own way to retry).
    ``replay``: the answer to a call that found the operation an earlier call made."""
    outcome = outcome_of(op["status"])
    action = op.get("action") or "the action"
    if outcome is Outcome.SUCCEEDED:
        ref = (op.get("result") or {}).get("reference")
        done = f"{action} succeeded" + (f" (reference {ref})" if ref else "")
        if replay:
            return f"Already done: an earlier call with these arguments did it: {done}; do not retry."
        return f"Done: {done}; do not retry."
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
    if stage_of(op) is Stage.QUEUED:
        return (
            f"Queued, not sent yet: {action} waits for its turn; nothing has been sent to the provider. Wait for it "
            "or check later, do not resubmit."
        )
    if op.get("status") == Status.DISPATCHING.value:
        return (
            f"In progress, not finished: {action} is being sent to the provider now; wait for it or check later, "
            "do not resubmit."
        )
    why = op.get("reason") or "an earlier try did not finish"
    return (
        f"In progress, not finished: {action} was tried and is tried again under the same idempotency key ({why}); "
        "wait for it or check later, do not resubmit."
    )


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


def with_outcome(op: dict[str, Any], *, replay: bool = False) -> dict[str, Any]:
    """The operation's JSON plus ``outcome``, ``stage`` and ``model_message`` (``replay``: model_message)."""
    stage = stage_of(op)
    return op | {
        "outcome": outcome_of(op["status"]).value,
        "stage": stage.value if stage is not None else None,
        "model_message": model_message(op, replay=replay),
    }
