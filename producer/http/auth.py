"""Who is calling: API keys (Bearer), scopes, the per-key rate limit, and the app's shared state.

Every route reads the caller through ``require(scope)``; every read and write is scoped to the
key's tenant, and another tenant's operation is 404, never 403 (its existence is not confirmed).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from outbox.access.keys import Caller, verify
from outbox.ledger.provider_keys import SubmitRules
from outbox.settings import Settings
from producer.http.intake import BacklogGate
from producer.http.problems import Problem
from producer.http.waiters import Waiters

# Keys are verified against the ledger at most this often per key (a revoke takes this long).
KEY_CACHE_S = 5.0


@dataclass
class RateLimiter:
    """A token bucket per key: ``rate_per_s`` sustained, ``burst`` at once (per server process)."""

    rate_per_s: float
    burst: float
    buckets: dict[Hashable, tuple[float, float]] = field(default_factory=dict)  # key id -> (tokens, at)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def peek(self, key_id: Hashable) -> float:
        """take() without taking: 0 if a request would be allowed now."""
        now = time.monotonic()
        with self.lock:
            tokens, at = self.buckets.get(key_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
            return 0.0 if tokens >= 1 else (1 - tokens) / self.rate_per_s

    def take(self, key_id: Hashable) -> float:
        """0 if allowed, else the seconds until a request would be."""
        now = time.monotonic()
        with self.lock:
            tokens, at = self.buckets.get(key_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
            if tokens >= 1:
                self.buckets[key_id] = (tokens - 1, now)
                return 0.0
            self.buckets[key_id] = (tokens, now)
            return (1 - tokens) / self.rate_per_s


@dataclass
class ApiState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    rules: SubmitRules | None
    waiters: Waiters
    limiter: RateLimiter
    keys: dict[str, tuple[Caller | None, float]] = field(default_factory=dict)  # presented key -> (caller, at)
    # Unknown keys cost a ledger query each: a client that keeps presenting them is slowed down.
    failures: RateLimiter = field(default_factory=lambda: RateLimiter(5.0, 20.0))
    # New intents past a tenant's backlog limit are answered 429 (producer/http/intake.py); 0: off.
    backlog: BacklogGate = field(default_factory=lambda: BacklogGate(0))

    def cached_caller(self, presented: str) -> tuple[bool, Caller | None]:
        """(True, the caller or None for an unknown key) when verified within KEY_CACHE_S; (False, None)
        when the ledger must be asked (caller_for)."""
        cached = self.keys.get(presented)
        if cached is not None and time.monotonic() - cached[1] < KEY_CACHE_S:
            return True, cached[0]
        return False, None

    def caller_for(self, presented: str) -> Caller | None:
        now = time.monotonic()
        known, caller = self.cached_caller(presented)
        if known:
            return caller
        with self.sessions() as session:
            caller = verify(session, presented)
        if len(self.keys) > 10_000:
            self.keys.clear()
        self.keys[presented] = (caller, now)
        return caller


def state(request: Request) -> ApiState:
    st: ApiState = request.app.state.api
    return st


async def authenticated(request: Request) -> Caller:
    """The caller of a request, or a 401/429 problem. A coroutine: FastAPI would run a plain function
    in its thread pool, a hand-over per request (and per route's scope check) that costs more than
    the check; the ledger is asked in the thread pool only when the key's cache entry is stale."""
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise Problem(
            401,
            "unauthorized",
            "Unauthorized",
            "send Authorization: Bearer <key> (agent-outbox keys create)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    client = request.client.host if request.client else "?"
    if state(request).failures.peek(client) > 0:
        raise Problem(
            429,
            "rate-limited",
            "Too many requests",
            "too many unknown keys from this address",
            headers={"Retry-After": "1"},
        )
    known, caller = state(request).cached_caller(presented.strip())
    if not known:
        caller = await run_in_threadpool(state(request).caller_for, presented.strip())
    if caller is None:
        state(request).failures.take(client)
        raise Problem(
            401, "unauthorized", "Unauthorized", "unknown or revoked API key", headers={"WWW-Authenticate": "Bearer"}
        )
    wait_s = state(request).limiter.take(caller.key_id)
    if wait_s > 0:
        raise Problem(
            429,
            "rate-limited",
            "Too many requests",
            f"this key's rate limit ({state(request).limiter.rate_per_s:g}/s) is used up",
            headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
        )
    return caller


def require(scope: str) -> Callable[[Caller], Awaitable[Caller]]:
    async def check(caller: Caller = Depends(authenticated)) -> Caller:  # noqa: B008 - FastAPI's dependency idiom
        if scope not in caller.scopes:
            raise Problem(403, "forbidden", "Forbidden", f"this key lacks the {scope!r} scope")
        return caller

    return check
