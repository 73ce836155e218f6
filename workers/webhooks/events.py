"""Reading a verified event with the actions file: which actions of its target map its type, what
each says it means (succeeded / failed / pending), and the object, key and reference it carries.

The key and the reference name the operation (the ledger finds it: outbox/evidence/webhooks.py).
With ``match:`` (as a lookup's: outbox/actions/matching.py), the operation an event names is its own
only if the object's declared fields equal the intent's arguments (``owner_check``: the ledger asks
it of every operation found; one it refuses is not the event's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox.actions.matching import MissingArgument, describe, mismatches
from outbox.evidence.webhooks import EventReading
from outbox.ledger.envelope import loads_exact
from outbox.ledger.models import Operation
from workers.provider.actions import ActionsFile
from workers.provider.classify import extract


def event_type(actions: ActionsFile, target: str, payload: dict[str, Any]) -> str:
    """The event's type as the target's actions read it (their ``type_field``; ``type`` by default)."""
    fields = [a.webhooks.type_field for a in actions.actions.values() if a.target == target and a.webhooks]
    for field in [*fields, "type"]:
        value = extract(payload, field)
        if isinstance(value, str) and value:
            return value[:200]
    return ""


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        return None
    text = str(value)
    return text[:255] if text else None


def readings(actions: ActionsFile, target: str, payload: dict[str, Any]) -> list[EventReading]:
    """One reading per action of ``target`` whose ``webhooks`` maps the event's type."""
    out = []
    for name, action in sorted(actions.actions.items()):
        spec = action.webhooks
        if action.target != target or spec is None:
            continue
        kind = extract(payload, spec.type_field)
        outcome = spec.outcome_of(kind) if isinstance(kind, str) else None
        if outcome is None:
            continue
        obj = extract(payload, spec.object_path)
        obj = obj if isinstance(obj, dict) else None
        ref_path = spec.reference_path(action.result_reference)
        out.append(
            EventReading(
                action=name,
                outcome=outcome,
                provider_key=_scalar(extract(obj, spec.key)) if obj is not None and spec.key else None,
                reference=_scalar(extract(obj, ref_path)) if obj is not None and ref_path else None,
                result=obj,
            )
        )
    return out


def redactor_for(actions: ActionsFile) -> Callable[[Operation, EventReading], dict[str, Any] | None]:
    """What is kept of an event's object on its operation: masked as the action masks a provider's
    answers (its sensitive_response_fields, and the intent's sensitive argument values wherever the
    provider echoes them), as a lookup's found object is."""

    def result(op: Operation, reading: EventReading) -> dict[str, Any] | None:
        action = actions.actions.get(reading.action)
        if reading.result is None or action is None:
            return None
        redactor = action.redactor(loads_exact(op.args)) if op.args else None
        masked = action.masked_response(reading.result, redactor)
        return masked if isinstance(masked, dict) else None

    return result


def owner_check(actions: ActionsFile) -> Callable[[Operation, EventReading], str | None]:
    """Why an operation the event names is not its own (None: it is): its action's ``webhooks.match``
    compares the event's object with the intent's arguments. Without a match: every one is."""

    def owns(op: Operation, reading: EventReading) -> str | None:
        action = actions.actions.get(reading.action)
        spec = action.webhooks if action is not None else None
        if spec is None or not spec.match:
            return None
        args = loads_exact(op.args) if op.args else {}
        try:
            wrong = mismatches(reading.result or {}, spec.match, args, idempotency_key=op.provider_key)
        except MissingArgument as exc:
            return f"operation {op.id} cannot be compared: {exc}"
        return f"operation {op.id} does not match: {describe(wrong)}" if wrong else None

    return owns
