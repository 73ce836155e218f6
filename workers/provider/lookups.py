"""What a lookup answer says: found (in which state), not found, ambiguous, or unavailable.

The provider was asked what became of an intent (``lookup`` in the actions file): by the key it saw
(its request names ``{idempotency_key}``: ``LookupSpec.by_key``), or by a business reference. A found
object is ours only if it carried our key (``key_field``: in a lookup by key an object without the
field is the key's, the provider filtered; in a lookup by reference only the exact key is ours) and its
declared fields equal the intent's arguments (``match``, outbox/actions/matching.py); objects that are
not ours are left out and counted (``others``), so a lookup that found only others' objects is a
not-found (whose weight the reconciler decides: authoritative_not_found, settle_s, fencing, and whether
the provider honours keys). Two or more candidates that are ours as far as the lookup can tell are
ambiguous: a person picks, never a guess. A HEAD answer has no body: its 2xx says an object exists
under the key, in a state it cannot tell unless ``exists_means: succeeded`` declares it. This only
reports what the provider said, in one vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from outbox.actions.matching import MissingArgument, describe, mismatches
from outbox.actions.specs import LookupSpec
from workers.provider.classify import extract

# Usual shapes of "a list of matches" in lookup answers, tried when lookup.items is not set.
LIST_FIELDS = ("data", "items", "results")

LookupOutcome = Literal["found", "not_found", "ambiguous", "unavailable"]
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
    # ambiguous: every candidate that is ours as far as the lookup can tell, by its reference
    candidates: tuple[str, ...] = ()
    others: int = 0  # objects found that key_field or lookup.match says are not ours (left out)


def interpret_lookup(
    status_code: int,
    body: bytes,
    spec: LookupSpec,
    result_reference: str | None,
    idempotency_key: str,
    latency_s: float = 0.0,
    args: Mapping[str, Any] | None = None,
) -> LookupResult:
    """Turn a lookup answer into found / not_found / ambiguous / unavailable; ``args``: the intent's
    arguments, compared with each candidate as ``spec.match`` declares.

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
    if spec.request.method == "HEAD":
        # No body: a 2xx says the key's object exists (a HEAD lookup is by key only), nothing of its
        # state: succeeded only where the action declares that existence means it.
        state: LookupState = "succeeded" if spec.exists_means == "succeeded" else "unknown"
        return result("found", f"HEAD {status_code} (exists_means: {spec.exists_means or 'unknown'})", state=state)
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return result("unavailable", "unparseable lookup body")
    items = _items(parsed, spec)
    if items is None:
        return result("unavailable", "lookup body is neither an object nor a list")
    seen = len(items)
    if spec.key_field is not None:
        items = [i for i in items if _carries_key(i, spec, idempotency_key)]
    if not items:
        if seen:
            return result(
                "not_found", f"found {seen} object(s), none of them ours ({spec.key_field} is not our key)", others=seen
            )
        return result("not_found", "empty result")
    if spec.match:
        try:
            ours, others = _ours(items, spec, args or {}, idempotency_key)
        except MissingArgument as exc:
            return result("unavailable", f"cannot verify a found object: {exc}")
        if not ours:
            # Only others' objects: for the not-found rules, the same as finding nothing.
            return result("not_found", f"found {seen} object(s), none of them ours (match: {others})", others=seen)
        items = ours
    if len(items) > 1:
        # Two objects that are ours as far as we can tell smell like two effects, or like someone
        # else's twin: a person must look, not a guess.
        refs = tuple(_reference(i, result_reference) for i in items)
        return result("ambiguous", f"{len(items)} objects match this intent: {', '.join(refs)}", candidates=refs)
    obj = items[0]
    if not isinstance(obj, dict):
        return result("unavailable", "found item is not an object")
    return _found(obj, spec, result_reference, result)


def verify_found(found: LookupResult, spec: LookupSpec, args: Mapping[str, Any], idempotency_key: str) -> LookupResult:
    """A lookup answer from any connector (a Python hook's too) held to ``spec.match`` (and, in a
    lookup by reference, to ``key_field``): a found object that is not ours is a not-found; one that
    cannot be compared proves nothing."""
    if found.outcome != "found" or not spec.match:
        return found
    if found.obj is None:
        return replace(found, outcome="unavailable", reason="found, but no object to compare (lookup.match)")
    if not _carries_key(found.obj, spec, idempotency_key):
        reason = f"found {found.provider_reference or 'an object'}, not ours ({spec.key_field} is not our key)"
        return replace(
            found, outcome="not_found", reason=reason, state=None, obj=None, provider_reference=None, others=1
        )
    try:
        wrong = mismatches(found.obj, spec.match, args, idempotency_key=idempotency_key)
    except MissingArgument as exc:
        return replace(found, outcome="unavailable", reason=f"cannot verify a found object: {exc}")
    if not wrong:
        return found
    reason = f"found {found.provider_reference or 'an object'}, not ours (match: {describe(wrong)})"
    return replace(found, outcome="not_found", reason=reason, state=None, obj=None, provider_reference=None, others=1)


def _carries_key(item: Any, spec: LookupSpec, idempotency_key: str) -> bool:
    """Whether ``item`` may be ours by its ``key_field``: our key, or (a lookup by key, where the
    provider filtered) no such field; a lookup by reference adopts only what carries our key exactly."""
    if not isinstance(item, dict) or spec.key_field is None:
        return True
    key = extract(item, spec.key_field)
    return key == idempotency_key or (key is None and spec.by_key)


def _ours(items: list[Any], spec: LookupSpec, args: Mapping[str, Any], idempotency_key: str) -> tuple[list[Any], str]:
    """The candidates whose declared fields are the intent's, and why the others are not (paths)."""
    ours: list[Any] = []
    why: list[str] = []
    for item in items:
        wrong = mismatches(item, spec.match, args, idempotency_key=idempotency_key)
        if wrong:
            why.append(describe(wrong))
        else:
            ours.append(item)
    return ours, "; ".join(sorted(set(why)))


def _reference(item: Any, result_reference: str | None) -> str:
    ref = extract(item, result_reference) if result_reference and isinstance(item, dict) else None
    return "(no reference)" if ref is None else str(ref)


def _found(
    obj: dict[str, Any], spec: LookupSpec, result_reference: str | None, result: Callable[..., LookupResult]
) -> LookupResult:
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
    if spec.items is not None:
        found = extract(parsed, spec.items)
        return found if isinstance(found, list) else None
    for name in LIST_FIELDS:
        found = parsed.get(name)
        if isinstance(found, list):
            return found
    return [parsed]  # a single object answer
