"""What a lookup answer says: found (in which state), not found, or unavailable.

The provider was asked what became of an idempotency key (``lookup`` in the actions file). Whether
"not found" proves that the request never took effect is not decided here: that is the
reconciler's call (authoritative_not_found, settle_s, fencing); this only reports what the
provider said, in one vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from outbox.actions.specs import LookupSpec
from workers.provider.classify import extract

# Usual shapes of "a list of matches" in lookup answers, tried when items_field is not set.
LIST_FIELDS = ("data", "items", "results")

LookupOutcome = Literal["found", "not_found", "unavailable"]
LookupState = Literal["succeeded", "pending", "failed", "unknown"]


@dataclass(frozen=True)
class LookupResult:
    outcome: LookupOutcome
    reason: str
    state: LookupState | None = None  # set when found
    obj: dict[str, Any] | None = None  # the provider's object, when found
    provider_reference: str | None = None
    status_code: int | None = None
    latency_s: float = 0.0


def interpret_lookup(
    status_code: int,
    body: bytes,
    spec: LookupSpec,
    result_reference: str | None,
    idempotency_key: str,
    latency_s: float = 0.0,
) -> LookupResult:
    """Turn a lookup answer into found / not_found / unavailable.

    Whether not_found proves "never executed" is the reconciler's call (authoritative_not_found
    and settle_s); this only reports what the provider said.
    """

    def result(outcome: LookupOutcome, reason: str, **kw: Any) -> LookupResult:
        return LookupResult(outcome, reason, status_code=status_code, latency_s=latency_s, **kw)

    if status_code == 404:
        return result("not_found", "http_404")
    if not 200 <= status_code < 300:
        # 429/5xx: try later. Other 4xx (auth, bad query) prove nothing about the effect either.
        return result("unavailable", f"http_{status_code}")
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return result("unavailable", "unparseable lookup body")
    items = _items(parsed, spec)
    if items is None:
        return result("unavailable", "lookup body is neither an object nor a list")
    if spec.key_field is not None:
        items = [i for i in items if not isinstance(i, dict) or extract(i, spec.key_field) in (None, idempotency_key)]
    if not items:
        return result("not_found", "empty result")
    if len(items) > 1:
        # Two objects for one key smell like two effects: a person must look, not a guess.
        return result("unavailable", f"multiple_matches: {len(items)} objects for one key")
    obj = items[0]
    if not isinstance(obj, dict):
        return result("unavailable", "found item is not an object")
    status = extract(obj, spec.status_field)
    state: LookupState = "unknown"
    if status in spec.succeeded:
        state = "succeeded"
    elif status in spec.pending:
        state = "pending"
    elif status in spec.failed:
        state = "failed"
    reference = extract(obj, result_reference) if result_reference else None
    return result(
        "found",
        f"{spec.status_field}={status!r}",
        state=state,
        obj=obj,
        provider_reference=None if reference is None else str(reference),
    )


def _items(parsed: Any, spec: LookupSpec) -> list[Any] | None:
    if isinstance(parsed, list):
        return parsed
    if not isinstance(parsed, dict):
        return None
    if spec.items_field is not None:
        found = extract(parsed, spec.items_field)
        return found if isinstance(found, list) else None
    for name in LIST_FIELDS:
        found = parsed.get(name)
        if isinstance(found, list):
            return found
    return [parsed]  # a single object answer
