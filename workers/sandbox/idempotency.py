"""Stripe-like idempotency keys: stored first response, replay, mismatch, in-flight, retention.

Modelled on Stripe's published rules (https://docs.stripe.com/api/idempotent_requests):
the first response for a key is saved and replayed for later requests with the same key;
reuse with different parameters is an error; a concurrent request with the same key gets 409;
keys may be pruned after retention (24 h), after which the key is new again. Keys are scoped
by tenant (Stripe: per account). See workers/sandbox/README.md for where we deliberately differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


def params_digest(method: str, path: str, body: dict[str, Any]) -> str:
    """sha256 of the endpoint and canonical body: the same key on another endpoint is a mismatch."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{method} {path}\n{canonical}".encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    status: int
    body: bytes  # replayed byte-for-byte
    request_id: str  # sent back as Original-Request on replays


@dataclass
class KeyRecord:
    digest: str
    first_seen: float
    response: StoredResponse | None = None  # None while the first request is in flight


class KeyMismatch(Exception):
    """The key was first used with other parameters (Stripe: idempotency_error)."""


class KeyInUse(Exception):
    """The first request for this key is still being processed."""


@dataclass
class KeyStore:
    records: dict[tuple[str, str], KeyRecord] = field(default_factory=dict)

    def begin(
        self, tenant: str, key: str, digest: str, now: float, retention_s: float, *, check_digest: bool = True
    ) -> StoredResponse | None:
        """Reserve the key, or return the stored response to replay; raise on conflict.
        ``check_digest=False`` plays a provider that never compares the parameters (a fault mode).

        Expiry is checked lazily here: a record older than retention is forgotten, so the same
        key then creates a new object, as it does at real providers after pruning.
        """
        record = self.records.get((tenant, key))
        if record is not None and now - record.first_seen >= retention_s:
            del self.records[(tenant, key)]
            record = None
        if record is None:
            self.records[(tenant, key)] = KeyRecord(digest=digest, first_seen=now)
            return None
        if check_digest and record.digest != digest:
            raise KeyMismatch(key)
        if record.response is None:
            raise KeyInUse(key)
        return record.response

    def complete(self, tenant: str, key: str, response: StoredResponse) -> None:
        record = self.records.get((tenant, key))
        if record is not None:
            record.response = response

    def release(self, tenant: str, key: str) -> None:
        """Forget an in-flight key whose request did not execute, so a retry may run it."""
        record = self.records.get((tenant, key))
        if record is not None and record.response is None:
            del self.records[(tenant, key)]


@dataclass
class FencingBook:
    """Highest X-Fencing-Token seen per (tenant, key), for strict mode.

    A zombie worker that lost its lease still holds its old token; once a higher token for the key
    reached the provider (the successor's request, or the reconciler's lookup), the zombie's
    request is refused with stale_token: on arrival, and again when it would commit, so a request
    that was already being processed when the higher token arrived cannot land either.
    """

    highest: dict[tuple[str, str], int] = field(default_factory=dict)

    def admit(self, tenant: str, key: str, token: int) -> int | None:
        """Record the token; return the higher token already seen if this one is stale."""
        seen = self.stale(tenant, key, token)
        if seen is None:
            self.highest[(tenant, key)] = token
        return seen

    def stale(self, tenant: str, key: str, token: int) -> int | None:
        """The higher token already seen for the key, if ``token`` is older; None otherwise."""
        seen = self.highest.get((tenant, key))
        return seen if seen is not None and token < seen else None

    def observe(self, tenant: str, key: str, token: int) -> None:
        """A read (lookup) carried this token: older ones are refused from now on."""
        if token > self.highest.get((tenant, key), -1):
            self.highest[(tenant, key)] = token
