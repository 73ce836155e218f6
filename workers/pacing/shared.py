"""Limits shared by the fleet in Redis: one Lua script per call, so a call costs one round trip.

Key layout (one deployment's namespace, one target)::

    agent-outbox:pacing:{namespace}:processes                  zset: process id -> heartbeat expiry (ms)
    agent-outbox:pacing:{namespace}:{target}:rate              string: GCRA theoretical arrival time (us)
    agent-outbox:pacing:{namespace}:{target}:tenant:{t}:rate   string: the same, for one tenant at the target
    agent-outbox:pacing:{namespace}:{target}:slots             zset: holder -> lease expiry (us)
    agent-outbox:pacing:{namespace}:{target}:admitted          hash: calls admitted this second and the last
    agent-outbox:pacing:{namespace}:{target}:rate:lines        zset: tenant -> when its last call sent back returns (us)
    agent-outbox:pacing:{namespace}:{target}:rate:active       zset: tenant -> until when it holds a turn or waits in line (us)
    agent-outbox:pacing:{namespace}:{target}:rate:held:{t}     zset: the turns ahead tenant t holds (score: when each comes)
    agent-outbox:pacing:{namespace}:{target}:tenant:{t}:rate:lines   the same, for one tenant's own rate

Rates are GCRA: a key holds one time, the "theoretical arrival time" (TAT) of the next call; a
call conforms when TAT - tolerance <= now, and moves TAT one interval on. Nothing is held, so a
worker that dies leaks nothing, and a key that expires (PX until its TAT) is the same as a full
burst. A call that would conform within ``max_wait`` reserves its turn (TAT moves now) and sleeps
until it, instead of asking again: one round trip per call, and callers never race for a turn.
A tenant holds at most its share of the turns ahead (the next ``horizon``'s turns over the tenants
active at the key), so a tenant arriving behind another's backlog finds its turn within the horizon;
a call sent back waits in its tenant's line, not behind other tenants' calls.

Concurrency is a sorted set of holders scored by their lease's end: expired holders are dropped
before counting, so a worker killed while holding a slot leaks it only until its lease ends.

The same call refreshes the process's heartbeat and returns how many processes are live: with
Redis away, each process keeps to its share of every limit (workers/pacing/pacer.py).

Times are Redis server time (``TIME``), so worker clocks do not matter; durations come back in
whole microseconds (Lua numbers reach Redis as integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from workers.pacing.limits import Ask, PaceDecision, whole_us

KEY_PREFIX = "agent-outbox:pacing"

# KEYS: processes, admitted, slots, rate keys... ARGV: process id, heartbeat ttl ms, max wait us,
# slots (0: no concurrency limit), holder, slot lease us, no turn before this many us from now, tenant,
# share horizon us, then (interval us, tolerance us) per rate key -> {code (0 go, 1 rate, 2 concurrency), wait us, the rate that set the wait (1-based; 0 none), live}
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
redis.call('PEXPIRE', KEYS[1], ttl)
local live = redis.call('ZCARD', KEYS[1])
local wait, which, tats = 0, 0, {}
local floor = tonumber(ARGV[7])
for i = 4, #KEYS do
  local j = 10 + (i - 4) * 2
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local w = math.max(tat - tonumber(ARGV[j + 1]) - now, floor)
  if w > wait then wait, which = w, i - 3 end
  tats[i] = tat
end
local max_wait = tonumber(ARGV[3])
local me = ARGV[8]
local horizon = tonumber(ARGV[9])
local nows = string.format('%.0f', now)
-- Each tenant holds at most its share of a key's turns ahead: the turns of the next ``horizon`` over
-- the tenants active at that key (holding turns ahead or waiting in line), itself included, at
-- least one. A tenant alone holds the horizon's turns; a tenant arriving behind its backlog holds
-- none, so its call takes the turn right after them, within its wait in its thread (the horizon is
-- shorter), instead of being sent back while the backlog keeps every turn of the next second taken.
local over = false
for i = 4, #KEYS do
  local j = 10 + (i - 4) * 2
  local active = KEYS[i] .. ':active'
  redis.call('ZREMRANGEBYSCORE', active, '-inf', nows)
  local others = redis.call('ZCARD', active)
  if redis.call('ZSCORE', active, me) then others = others - 1 end
  local held = KEYS[i] .. ':held:' .. me
  redis.call('ZREMRANGEBYSCORE', held, '-inf', nows)
  local share = math.max(1, math.ceil(horizon / tonumber(ARGV[j]) / (1 + others)))
  if redis.call('ZCARD', held) >= share then over = true end
end
local function mark_active(key, untilt)
  local active = key .. ':active'
  local was = tonumber(redis.call('ZSCORE', active, me))
  if not was or untilt > was then redis.call('ZADD', active, string.format('%.0f', untilt), me) end
  local last = redis.call('ZRANGE', active, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', active, math.ceil((tonumber(last[2]) - now) / 1000) + 1)
end
if wait > max_wait or (wait > 0 and over) then
  -- Sent back to the ledger: it comes back at its place in its tenant's line of calls sent back
  -- (none before its turn could come: now + wait, which the floor may set past the rate's own
  -- turn), so a backlog returns at the rate it can be sent instead of all at once, to be sent back
  -- again. One line per tenant: a tenant's calls come back one interval apart from each other, and
  -- not behind another tenant's line, so one tenant's backlog delays another's call by about an
  -- interval, not by the whole backlog. Lines of several tenants together may bring back more calls
  -- than the rate has turns: those without a turn go back to the end of their own line (every turn
  -- is used; a line stepping by one interval per tenant waiting left turns unused once the other
  -- tenant's call had gone: 38/s of a 50/s limit in bench.fairness).
  local k = KEYS[which + 3]
  local j = 10 + (which - 1) * 2
  local lines = k .. ':lines'
  redis.call('ZREMRANGEBYSCORE', lines, '-inf', nows)
  local mine = tonumber(redis.call('ZSCORE', lines, me))
  local q = now + wait
  if mine then q = math.max(mine + tonumber(ARGV[j]), q) end
  redis.call('ZADD', lines, string.format('%.0f', q), me)
  local last = redis.call('ZRANGE', lines, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', lines, math.ceil((tonumber(last[2]) - now) / 1000) + 1)
  mark_active(k, q)
  return {1, math.ceil(q - now), which, live}
end
local slots = tonumber(ARGV[4])
if slots > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', string.format('%.0f', now))
  if redis.call('ZCARD', KEYS[3]) >= slots then
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    return {2, math.ceil(tonumber(first[2]) - now), 0, live}
  end
  local lease = tonumber(ARGV[6])
  redis.call('ZADD', KEYS[3], string.format('%.0f', now + wait + lease), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], math.ceil((max_wait + lease) / 1000) + 1000)
end
local send = now + wait
for i = 4, #KEYS do
  local j = 10 + (i - 4) * 2
  local tat = math.max(tats[i], send) + tonumber(ARGV[j])
  local ttl = math.ceil((tat - now) / 1000) + 1
  redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', ttl)
  if wait > 0 then  -- a turn ahead, held by this tenant until it comes (the member: the turn's TAT, unique)
    local held = KEYS[i] .. ':held:' .. me
    redis.call('ZADD', held, string.format('%.0f', send), string.format('%.0f', tat))
    redis.call('PEXPIRE', held, ttl)
    mark_active(KEYS[i], send)
  end
end
local sec = math.floor(now / 1000000)
local seen = redis.call('HMGET', KEYS[2], 'sec', 'n')
if tonumber(seen[1]) == sec then
  redis.call('HINCRBY', KEYS[2], 'n', 1)
else
  local prev = 0
  if tonumber(seen[1]) == sec - 1 then prev = tonumber(seen[2]) or 0 end
  redis.call('HSET', KEYS[2], 'sec', sec, 'n', 1, 'prev', prev)
  redis.call('EXPIRE', KEYS[2], 5)
end
return {0, math.ceil(wait), which, live}
"""

# KEYS: admitted, slots -> {calls admitted in the last whole second, slots held now}
_READ = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local sec = math.floor(now / 1000000)
local seen = redis.call('HMGET', KEYS[1], 'sec', 'n', 'prev')
local rate = 0
if tonumber(seen[1]) == sec then rate = tonumber(seen[3]) or 0
elseif tonumber(seen[1]) == sec - 1 then rate = tonumber(seen[2]) or 0 end
return {rate, redis.call('ZCOUNT', KEYS[2], '(' .. string.format('%.0f', now), '+inf')}
"""

# A process counts as live this long after its last call to a limited target. Long, because the
# count only ever divides a limit: a process that died is counted a minute too long (its peers keep
# to a smaller share during an outage), one that is merely quiet is not forgotten between bursts.
HEARTBEAT_S = 60.0


@dataclass(frozen=True)
class Reading:
    """A target's limits now, for people: calls admitted in the last whole second, slots held."""

    admitted_last_s: int
    in_flight: int


class RedisPacing:
    """The fleet's limits in one Redis, under one deployment's namespace."""

    kind = "redis"

    def __init__(self, client: redis.Redis, namespace: str, process_id: str) -> None:
        self._redis = client
        self._base = f"{KEY_PREFIX}:{namespace}"
        self._process_id = process_id
        self._acquire = client.register_script(_ACQUIRE)
        self._read = client.register_script(_READ)

    def key(self, target: str, name: str) -> str:
        return f"{self._base}:{target}:{name}"

    def acquire(self, ask: Ask) -> PaceDecision:
        keys = [f"{self._base}:processes", self.key(ask.target, "admitted"), self.key(ask.target, "slots")]
        args: list[str | int] = [
            self._process_id,
            round(HEARTBEAT_S * 1000),
            whole_us(ask.max_wait_s),
            ask.slots or 0,
            ask.holder,
            whole_us(ask.slot_lease_s),
            whole_us(ask.not_before_s),
            ask.tenant,
            whole_us(ask.horizon_s),
        ]
        for scope in ask.scopes:
            keys.append(self.key(ask.target, scope.key))
            args += [whole_us(scope.rate.interval_s), whole_us(scope.rate.tolerance_s)]
        code, wait_us, which, live = self._acquire(keys=keys, args=args)
        wait_s, live = int(wait_us) / 1_000_000, int(live)
        held_by = ask.scopes[int(which) - 1] if int(which) > 0 else None
        if code == 0:
            return PaceDecision(True, wait_s, scope=held_by, live=live)
        if code == 1:
            return PaceDecision(False, wait_s, "rate", held_by, live=live)
        return PaceDecision(False, wait_s, "concurrency", live=live)

    def release(self, target: str, holder: str) -> None:
        self._redis.zrem(self.key(target, "slots"), holder)

    def reading(self, target: str) -> Reading:
        rate, busy = self._read(keys=[self.key(target, "admitted"), self.key(target, "slots")])
        return Reading(int(rate), int(busy))
