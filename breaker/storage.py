"""Breaker state shared by all processes through Redis.

Replaces pybreaker's ``CircuitRedisStorage``, whose problems bite in 1.4.1 (see README.md):
every decision and every recorded result is one Lua script, so the read-decide-write of a
transition is atomic across processes, and the half-open probe is a ``SET NX PX`` lock so
exactly one caller in the whole fleet probes.

Key layout (one target)::

    agent-outbox:breaker:{namespace}:{target}:state   hash: state, failures, successes,
                                                      opened_at_ms, reopens_at_ms,
                                                      reset_by, reset_at_ms
    agent-outbox:breaker:{namespace}:{target}:probe   string: probe token, PX probe_timeout

A missing hash means closed with no failures, so nothing is initialised on start-up and a new
process can never reset the shared counter (pybreaker#26). Times are Redis server time
(``TIME``) unless a clock is injected, so worker clock skew does not move reopen times.

Errors are not swallowed: a ``RedisError`` reaches the registry, which falls back to a
process-local breaker; this store never pretends to be closed (stock pybreaker does).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import redis
from pybreaker import CircuitBreakerStorage

from breaker.config import BreakerConfig
from breaker.state import Admission, Recorded, Snapshot, StateName, from_ms

KEY_PREFIX = "agent-outbox:breaker"

# Shared prelude: now in ms from ARGV[1], or Redis server time when ARGV[1] is empty.
_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: state, probe. ARGV: now_ms, reset_timeout_ms, probe_timeout_ms, token, probe_wait_ms
# -> {allowed(0/1), token, reopens_at_ms, transition, failures, now_ms}
_ADMIT = (
    _NOW
    + """
local st = redis.call('HMGET', KEYS[1], 'state', 'failures', 'reopens_at_ms')
local state = st[1] or 'closed'
local failures = tonumber(st[2]) or 0
if state == 'closed' then return {1, '', 0, '', failures, now} end
local transition = ''
if state == 'open' then
  local reopens = tonumber(st[3]) or 0
  if now < reopens then return {0, '', reopens, '', failures, now} end
  redis.call('HSET', KEYS[1], 'state', 'half-open', 'successes', 0)
  transition = 'half-open'
end
if redis.call('SET', KEYS[2], ARGV[4], 'NX', 'PX', ARGV[3]) then
  return {1, ARGV[4], 0, transition, failures, now}
end
local wait = tonumber(ARGV[5])
local pttl = redis.call('PTTL', KEYS[2])
if pttl > 0 and pttl < wait then wait = pttl end
return {0, '', now + wait, transition, failures, now}
"""
)

# KEYS: state, probe. ARGV: now_ms, token ('' = not a probe), failure (0/1), fail_max,
# reset_timeout_ms, success_threshold -> {state, transition, failures, successes}
_SETTLE = (
    _NOW
    + """
local st = redis.call('HMGET', KEYS[1], 'state', 'failures', 'successes')
local state = st[1] or 'closed'
local failures = tonumber(st[2]) or 0
local successes = tonumber(st[3]) or 0
local failure = ARGV[3] == '1'
local function open()
  redis.call('HSET', KEYS[1], 'state', 'open', 'successes', 0, 'opened_at_ms', now,
             'reopens_at_ms', now + tonumber(ARGV[5]))
  redis.call('DEL', KEYS[2])
  return {'open', 'open', failures, 0}
end
if ARGV[2] == '' then
  if state ~= 'closed' then return {state, '', failures, successes} end
  if not failure then
    if failures > 0 then redis.call('HSET', KEYS[1], 'failures', 0) end
    return {'closed', '', 0, 0}
  end
  failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
  if failures >= tonumber(ARGV[4]) then return open() end
  redis.call('HSET', KEYS[1], 'state', 'closed')
  return {'closed', '', failures, 0}
end
local holder = redis.call('GET', KEYS[2])
if state ~= 'half-open' or (holder and holder ~= ARGV[2]) then
  return {state, '', failures, successes}
end
redis.call('DEL', KEYS[2])
if failure then return open() end
successes = redis.call('HINCRBY', KEYS[1], 'successes', 1)
if successes >= tonumber(ARGV[6]) then
  redis.call('HSET', KEYS[1], 'state', 'closed', 'failures', 0, 'successes', 0)
  redis.call('HDEL', KEYS[1], 'opened_at_ms', 'reopens_at_ms')
  return {'closed', 'closed', 0, 0}
end
return {'half-open', '', failures, successes}
"""
)

# KEYS: state, probe. ARGV: now_ms, by -> previous state
_RESET = (
    _NOW
    + """
local previous = redis.call('HGET', KEYS[1], 'state') or 'closed'
redis.call('HSET', KEYS[1], 'state', 'closed', 'failures', 0, 'successes', 0,
           'reset_by', ARGV[2], 'reset_at_ms', now)
redis.call('HDEL', KEYS[1], 'opened_at_ms', 'reopens_at_ms')
redis.call('DEL', KEYS[2])
return previous
"""
)


# KEYS: probe. ARGV: token -> 1 if this token held the probe and let it go
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _ms_arg(now_ms: int | None) -> str:
    return "" if now_ms is None else str(now_ms)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBreakerStorage(CircuitBreakerStorage):
    """One target's breaker state in Redis, shared by every process using the same
    namespace. ``now_ms=None`` means "use Redis server time"."""

    kind = "redis"

    def __init__(self, client: redis.Redis, namespace: str, target: str) -> None:
        super().__init__("redis")
        self._redis = client
        base = f"{KEY_PREFIX}:{namespace}:{target}"
        self.state_key, self.probe_key = f"{base}:state", f"{base}:probe"
        self._keys = [self.state_key, self.probe_key]
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._reset = client.register_script(_RESET)
        self._release = client.register_script(_RELEASE)

    def admit(self, config: BreakerConfig, now_ms: int | None) -> Admission:
        token = uuid.uuid4().hex
        allowed, got, reopens, transition, failures, now = self._admit(
            keys=self._keys,
            args=[
                _ms_arg(now_ms),
                int(config.reset_timeout_s * 1000),
                int(config.probe_timeout_s * 1000),
                token,
                int(config.probe_wait_s * 1000),
            ],
        )
        return Admission(
            allowed=bool(allowed),
            probe_token=_str(got) or None,
            reopens_at_ms=int(reopens) or None,
            transition=(_str(transition) or None),  # type: ignore[arg-type]
            failures=int(failures),
            now_ms=int(now),
        )

    def settle(self, config: BreakerConfig, probe_token: str | None, failure: bool, now_ms: int | None) -> Recorded:
        state, transition, failures, successes = self._settle(
            keys=self._keys,
            args=[
                _ms_arg(now_ms),
                probe_token or "",
                int(failure),
                config.fail_max,
                int(config.reset_timeout_s * 1000),
                config.success_threshold,
            ],
        )
        return Recorded(
            state=_str(state),  # type: ignore[arg-type]
            transition=(_str(transition) or None),  # type: ignore[arg-type]
            failures=int(failures),
            successes=int(successes),
        )

    def release(self, probe_token: str) -> bool:
        """Give back a probe that sent nothing (compare-and-delete: never someone else's)."""
        return bool(self._release(keys=[self.probe_key], args=[probe_token]))

    def reset(self, by: str, now_ms: int | None) -> StateName:
        return _str(self._reset(keys=self._keys, args=[_ms_arg(now_ms), by]))  # type: ignore[return-value]

    def snapshot(self, now_ms: int | None = None) -> Snapshot:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hgetall(self.state_key)
        pipe.exists(self.probe_key)
        fields_raw, probing = pipe.execute()
        fields = {_str(k): _str(v) for k, v in fields_raw.items()}

        def opt_int(name: str) -> int | None:
            return int(fields[name]) if name in fields else None

        return Snapshot(
            state=fields.get("state", "closed"),  # type: ignore[arg-type]
            failures=int(fields.get("failures", 0)),
            successes=int(fields.get("successes", 0)),
            opened_at_ms=opt_int("opened_at_ms"),
            reopens_at_ms=opt_int("reopens_at_ms"),
            probing=bool(probing),
        )

    # pybreaker's CircuitBreakerStorage interface, for introspection and compatibility.
    # Unlike CircuitRedisStorage these raise RedisError instead of answering "closed".
    @property
    def state(self) -> str:
        return self.snapshot().state

    @state.setter
    def state(self, state: str) -> None:
        self._redis.hset(self.state_key, "state", state)

    def increment_counter(self) -> None:
        self._redis.hincrby(self.state_key, "failures", 1)

    def reset_counter(self) -> None:
        self._redis.hset(self.state_key, "failures", 0)

    def increment_success_counter(self) -> None:
        self._redis.hincrby(self.state_key, "successes", 1)

    def reset_success_counter(self) -> None:
        self._redis.hset(self.state_key, "successes", 0)

    @property
    def counter(self) -> int:
        return self.snapshot().failures

    @property
    def success_counter(self) -> int:
        return self.snapshot().successes

    @property
    def opened_at(self) -> datetime | None:
        return from_ms(self.snapshot().opened_at_ms)

    @opened_at.setter
    def opened_at(self, now: datetime) -> None:
        # Milliseconds, not pybreaker's whole seconds (which shortens the timeout by up to 1 s).
        self._redis.hset(self.state_key, "opened_at_ms", int(now.timestamp() * 1000))
