"""Limits kept in this process's memory: the embedded deployment's, and every process's own share
while Redis is away. The same GCRA and lease-scored slots as in Redis (shared.py), on this process's
monotonic clock, under one lock (a call holds it for a few dictionary operations, never while it
waits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from workers.pacing.limits import Ask, PaceDecision


class LocalPacing:
    """One process's limiters, by the same key names as the shared ones."""

    kind = "local"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tats: dict[tuple[str, str], float] = {}  # (target, rate key) -> theoretical arrival time
        # (target, rate key) -> tenant -> when its last call sent back returns (shared.py's lines)
        self._lines: dict[tuple[str, str], dict[str, float]] = {}
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
            # While other tenants wait in line, a call waits in its thread only for its share of
            # the turns ahead (shared.py says why).
            others = 0
            for scope in ask.scopes:
                lines = self._lines.get((ask.target, scope.key), {})
                for tenant in [tenant for tenant, back in lines.items() if back <= now]:
                    del lines[tenant]
                others = max(others, len(lines) - (ask.tenant in lines))
            if wait > ask.max_wait_s / (1 + others):
                assert held_by is not None
                # Back to the ledger at its place in its tenant's line (shared.py says why).
                lines = self._lines.setdefault((ask.target, held_by.key), {})
                back = now + wait
                if (mine := lines.get(ask.tenant)) is not None:
                    back = max(mine + held_by.rate.interval_s, back)
                lines[ask.tenant] = back
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
            return PaceDecision(True, wait, scope=held_by)

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
            self._slots.clear()
            self._not_before = self._clock() + hold_s
