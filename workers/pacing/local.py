"""Limits kept in this process's memory: the embedded deployment's, and every process's own share
while Redis is away. The same GCRA and lease-scored slots as in Redis (shared.py), on this process's
monotonic clock, under one lock (a call holds it for a few dictionary operations, never while it
waits)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from workers.pacing.limits import Ask, PaceDecision, whole_us


class LocalPacing:
    """One process's limiters, by the same key names as the shared ones."""

    kind = "local"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tats: dict[tuple[str, str], float] = {}  # (target, rate key) -> theoretical arrival time
        # (target, rate key) -> tenant -> when its last call sent back returns (shared.py's lines)
        self._lines: dict[tuple[str, str], dict[str, float]] = {}
        # (target, rate key) -> tenant -> until when it holds a turn ahead or waits in line
        self._active: dict[tuple[str, str], dict[str, float]] = {}
        # (target, rate key, tenant) -> when each turn it holds comes, in order
        self._held: dict[tuple[str, str, str], deque[float]] = {}
        self._slots: dict[str, dict[str, float]] = {}  # target -> holder -> lease end
        self._not_before = float("-inf")  # no rate gives a turn before this (see forget)

    def acquire(self, ask: Ask) -> PaceDecision:
        """As RedisPacing.acquire, for this process alone (``ask`` already holds its share)."""
        with self._lock:
            now = self._clock()
            wait, held_by, tats = 0.0, None, []
            floor = max(self._not_before - now, ask.not_before_s)
            for scope in ask.scopes:
                tat = max(self._tats.get((ask.target, scope.key), now), now)
                w = max(tat - scope.rate.tolerance_s - now, floor)
                if w > wait:
                    wait, held_by = w, scope
                tats.append(tat)
            # A tenant holds at most its share of each key's turns ahead (shared.py says why).
            over = False
            for scope in ask.scopes:
                active = self._active.get((ask.target, scope.key), {})
                for tenant in [tenant for tenant, until in active.items() if until <= now]:
                    del active[tenant]
                others = len(active) - (ask.tenant in active)
                held = self._held.get((ask.target, scope.key, ask.tenant))
                while held and held[0] <= now:
                    held.popleft()
                # In whole microseconds, as Redis divides (shared.py): the same share on both.
                turns = whole_us(ask.horizon_s) / max(1, whole_us(scope.rate.interval_s))
                share = max(1, math.ceil(turns / (1 + others)))
                over = over or len(held or ()) >= share
            if wait > ask.max_wait_s or (wait > 0 and over):
                assert held_by is not None
                # Back to the ledger at its place in its tenant's line (shared.py says why).
                lines = self._lines.setdefault((ask.target, held_by.key), {})
                for tenant in [tenant for tenant, back in lines.items() if back <= now]:
                    del lines[tenant]
                back = now + wait
                if (mine := lines.get(ask.tenant)) is not None:
                    back = max(mine + held_by.rate.interval_s, back)
                lines[ask.tenant] = back
                self._mark_active(ask.target, held_by.key, ask.tenant, back)
                return PaceDecision(False, back - now, "rate", held_by)
            if ask.slots is not None:
                holders = self._slots.setdefault(ask.target, {})
                for holder in [h for h, until in holders.items() if until <= now]:
                    del holders[holder]
                if len(holders) >= ask.slots:
                    return PaceDecision(False, max(0.0, min(holders.values()) - now), "concurrency")
                holders[ask.holder] = now + wait + ask.slot_lease_s
            send = now + wait
            for scope, tat in zip(ask.scopes, tats):
                self._tats[(ask.target, scope.key)] = max(tat, send) + scope.rate.interval_s
                held_key = (ask.target, scope.key, ask.tenant)
                if wait > 0:  # a turn ahead, held by this tenant until it comes
                    self._held.setdefault(held_key, deque()).append(send)
                    self._mark_active(ask.target, scope.key, ask.tenant, send)
                elif not self._held.get(held_key, True):
                    del self._held[held_key]  # every turn it held has come: the tenant is forgotten
            return PaceDecision(True, wait, scope=held_by)

    def _mark_active(self, target: str, key: str, tenant: str, until: float) -> None:
        active = self._active.setdefault((target, key), {})
        active[tenant] = max(active.get(tenant, until), until)

    def release(self, target: str, holder: str) -> None:
        with self._lock:
            self._slots.get(target, {}).pop(holder, None)

    def in_flight(self, target: str) -> int:
        with self._lock:
            now = self._clock()
            return sum(1 for until in self._slots.get(target, {}).values() if until > now)

    def forget(self, hold_s: float) -> None:
        """Start afresh, giving no rate turn for ``hold_s`` (entering an outage: what this held is
        from an earlier one, and the turns Redis handed out, up to ``hold_s`` ahead, are still to go)."""
        with self._lock:
            self._tats.clear()
            self._lines.clear()
            self._active.clear()
            self._held.clear()
            self._slots.clear()
            self._not_before = self._clock() + hold_s
