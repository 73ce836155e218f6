"""Fault rules: what the sandbox does wrong, to which requests, how often.

A rule is matched against each non-admin request in order; the first rule that matches (and
wins its probability draw) fires. Each mode belongs to one phase of the request:
before commit (nothing happened), during processing (the key is in flight), or after commit
(the object exists and the response is lost, delayed or garbled).
"""

from __future__ import annotations

import collections
import fnmatch
import itertools
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

# mode -> one-line meaning (workers/sandbox/README.md lists the same table).
MODES: dict[str, str] = {
    "unavailable_503": "503 before commit, with Retry-After if retry_after_s is set (down / overloaded)",
    "rate_limited_429": "429 before commit, with Retry-After (default 1 s)",
    "drop_before_commit": "connection reset before anything is processed (down, connection refused-like)",
    "refuse": "alias of drop_before_commit",
    "fail_before_commit": "5xx (status, default 500) before commit; the key stays free, nothing exists",
    "stall_before_commit": "wait stall_s then reset, without processing (a black hole)",
    "refuse_credentials": "401 (or status 403) before commit: our credentials refused (revoked, expired, no permission)",
    "reject_422": "business rejection: 422 invalid_amount, nothing created",
    "reject_402": "business rejection: 402 amount_over_limit, nothing created (stored for replay)",
    "latency": "wait latency_ms while the key is in flight, then behave normally",
    "commit_then_drop": "commit, then reset the connection: the object exists, the client sees a reset",
    "commit_then_stall": "commit, then wait stall_s (past the client timeout) before answering",
    "commit_then_500": "commit, then answer 500",
    "commit_then_502": "commit, then answer 502 (a gateway lost the response)",
    "commit_then_504": "commit, then answer 504 (a gateway timed out)",
    "commit_then_error": "commit, then answer `status` (default 502)",
    "truncated_body": "commit, then 2xx whose JSON body is cut in half (consistent Content-Length)",
    "malformed_body": "commit, then 2xx with a non-JSON (HTML) body",
    "empty_body": "commit, then 2xx with an empty body",
    "commit_then_partial": "commit, then 2xx declaring the full Content-Length, half the body, reset",
    # A provider that breaks a declaration of the actions file (what `agent-outbox probe` checks).
    "ignore_idempotency_key": "a create ignores Idempotency-Key: every request makes a new object",
    "accept_changed_args": "a key reused with other parameters replays the first answer (200), never 409",
    "lookup_never_finds": "a lookup by key answers 404 even when the object exists",
    "lookup_lag": "a lookup by key sees an object only lag_s (default 2) after its creation",
    "ignore_fencing": "fencing tokens are neither recorded nor checked, even with strict_fencing",
}

BEFORE_COMMIT = frozenset(
    {
        "unavailable_503",
        "rate_limited_429",
        "drop_before_commit",
        "refuse",
        "fail_before_commit",
        "stall_before_commit",
        "refuse_credentials",
    }
)
AFTER_COMMIT = frozenset(
    {
        "commit_then_drop",
        "commit_then_stall",
        "commit_then_500",
        "commit_then_502",
        "commit_then_504",
        "commit_then_error",
        "truncated_body",
        "malformed_body",
        "empty_body",
        "commit_then_partial",
    }
)

_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (int,),
    "mode": (str,),
    "path": (str,),
    "method": (str,),
    "key_pattern": (str,),
    "tenant": (str,),
    "probability": (int, float),
    "seed": (int,),
    "count": (int,),
    "retry_after_s": (int, float),
    "retry_after_http_date": (bool,),
    "latency_ms": (int, float),
    "stall_s": (int, float),
    "status": (int,),
    "first_per_key": (bool,),
    "quota_per_s": (int, float),
    "lag_s": (int, float),
}


class RuleError(ValueError):
    """A fault rule body named an unknown mode or field, or gave a bad value."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class FaultRule:
    mode: str
    id: int = 0
    path: str | None = None  # exact path or glob ("/v1/*")
    method: str | None = None
    key_pattern: str | None = None  # glob, or a regex when prefixed "re:"
    tenant: str | None = None
    probability: float = 1.0
    seed: int | None = None
    count: int | None = None  # stop after firing this many times
    retry_after_s: float | None = None
    retry_after_http_date: bool = False
    latency_ms: float = 0.0
    stall_s: float = 10.0
    status: int | None = None
    # Only a key's first request (per method and path) can draw this rule: retries of the key
    # pass, as when a provider fails some first requests and answers every retry.
    first_per_key: bool = False
    # A provider's quota: the rule fires only for requests beyond this many (matching ones) admitted
    # in the trailing second; with rate_limited_429, a real rate limit to pace against.
    quota_per_s: float | None = None
    # lookup_lag: how long after its creation an object becomes visible to a lookup by key.
    lag_s: float = 2.0
    fired: int = 0
    _admitted: collections.deque[float] = field(default_factory=collections.deque, repr=False)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _key_re: re.Pattern[str] | None = field(default=None, repr=False)

    @property
    def exhausted(self) -> bool:
        return self.count is not None and self.fired >= self.count

    def matches(self, method: str, path: str, key: str | None, tenant: str) -> bool:
        if self.exhausted:
            return False
        if self.method is not None and self.method != method:
            return False
        if self.path is not None and self.path != path and not fnmatch.fnmatchcase(path, self.path):
            return False
        if self.tenant is not None and self.tenant != tenant:
            return False
        if self.key_pattern is not None:
            if key is None:
                return False
            if self._key_re is not None:
                if not self._key_re.search(key):
                    return False
            elif not fnmatch.fnmatchcase(key, self.key_pattern):
                return False
        if self.quota_per_s is not None:
            return self._over_quota(self.quota_per_s)
        # Drawn only for otherwise-matching requests: the same request sequence and seed
        # give the same faults on every run.
        return self.probability >= 1.0 or self._rng.random() < self.probability

    def _over_quota(self, per_s: float) -> bool:
        now = time.monotonic()
        while self._admitted and self._admitted[0] <= now - 1.0:
            self._admitted.popleft()
        if len(self._admitted) >= per_s:
            return True
        self._admitted.append(now)
        return False

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "mode": self.mode,
            "path": self.path,
            "method": self.method,
            "key_pattern": self.key_pattern,
            "tenant": self.tenant,
            "probability": self.probability,
            "seed": self.seed,
            "count": self.count,
            "retry_after_s": self.retry_after_s,
            "retry_after_http_date": self.retry_after_http_date,
            "latency_ms": self.latency_ms,
            "stall_s": self.stall_s,
            "status": self.status,
            "first_per_key": self.first_per_key,
            "quota_per_s": self.quota_per_s,
            "lag_s": self.lag_s,
            "fired": self.fired,
            "exhausted": self.exhausted,
        }


def parse_rule(body: Any, default_seed: int | None = None) -> FaultRule:
    """Validate a rule body; RuleError names the first bad field."""
    if isinstance(body, str):
        body = {"mode": body}
    if not isinstance(body, dict):
        raise RuleError("body", "must be a JSON object")
    for name, value in body.items():
        if name not in _FIELDS:
            raise RuleError(name, "unknown field")
        if value is None:
            continue
        kinds = _FIELDS[name]
        if isinstance(value, bool) and bool not in kinds:
            raise RuleError(name, "wrong type")
        if not isinstance(value, kinds):
            raise RuleError(name, f"must be {' or '.join(k.__name__ for k in kinds)}")
    mode = body.get("mode")
    if mode is None:
        raise RuleError("mode", "required")
    if mode not in MODES:
        raise RuleError("mode", f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    clean = {k: v for k, v in body.items() if v is not None}
    if "method" in clean:
        clean["method"] = clean["method"].upper()
    if not 0.0 <= clean.get("probability", 1.0) <= 1.0:
        raise RuleError("probability", "must be between 0 and 1")
    if clean.get("count", 1) < 1:
        raise RuleError("count", "must be >= 1")
    for name in ("retry_after_s", "latency_ms", "stall_s", "lag_s"):
        if clean.get(name, 0) < 0:
            raise RuleError(name, "must be >= 0")
    if clean.get("quota_per_s", 1) <= 0:
        raise RuleError("quota_per_s", "must be > 0 (requests admitted per trailing second)")
    if "status" in clean and not 100 <= clean["status"] <= 599:
        raise RuleError("status", "must be an HTTP status code")
    if mode == "refuse_credentials" and clean.get("status", 401) not in (401, 403):
        raise RuleError("status", "refuse_credentials answers 401 (unauthenticated) or 403 (no permission)")
    rule = FaultRule(**clean)
    seed = rule.seed if rule.seed is not None else default_seed
    rule._rng = random.Random(seed)
    if rule.key_pattern is not None and rule.key_pattern.startswith("re:"):
        try:
            rule._key_re = re.compile(rule.key_pattern[3:])
        except re.error as exc:
            raise RuleError("key_pattern", f"bad regex: {exc}") from exc
    return rule


@dataclass
class FaultBook:
    rules: list[FaultRule] = field(default_factory=list)
    default_seed: int | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _seen: set[tuple[str, str, str]] = field(default_factory=set)  # (method, path, key) requested so far

    def add(self, body: Any) -> FaultRule:
        rule = parse_rule(body, self.default_seed)
        rule.id = next(self._ids)
        self.rules.append(rule)
        return rule

    def remove(self, rule_id: int) -> bool:
        before = len(self.rules)
        self.rules = [r for r in self.rules if r.id != rule_id]
        return len(self.rules) != before

    def clear(self) -> None:
        self.rules.clear()

    def forget_keys(self) -> None:
        """Every key's next request counts as its first again (first_per_key)."""
        self._seen.clear()

    def select(self, method: str, path: str, key: str | None, tenant: str) -> FaultRule | None:
        first = False
        if key is not None and (method, path, key) not in self._seen:
            self._seen.add((method, path, key))
            first = True
        for rule in self.rules:
            if rule.first_per_key and not first:
                continue
            if rule.matches(method, path, key, tenant):
                rule.fired += 1
                return rule
        return None
