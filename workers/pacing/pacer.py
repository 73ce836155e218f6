"""The pacer: may this call leave now? Asked in the call's own thread, right before it is sent.

    cleared = pacer.clear("payments", tenant, max_wait_s=...)
    if isinstance(cleared, Deferred):
        ... not sent: back to the ledger for cleared.wait_s, the attempt not counted ...
    else:
        ... send (the pacer already slept cleared.waited_s) ...
        pacer.done(cleared)

A call over a limit waits in its thread when its turn comes within ``max_wait_s`` (its turn is
reserved, so it never asks twice for a rate); a longer wait is the caller's to schedule in the
ledger. A tenant holds at most its share of the next SHARE_HORIZON_S's turns (shared.py), less than
SHORT_WAIT_S, so a tenant behind another's backlog is not sent back for the turns that backlog holds.
A target without limits costs nothing: no lock, no Redis.

Where the limits are counted:

- with OUTBOX_REDIS_URL, in Redis for the whole fleet (shared.py);
- without it (the embedded deployment), in each process (local.py), each with the whole limit:
  a worker with several prefork children may send that many times the limit (docs/how-to/limits.md says so);
- with Redis away, in this process, with its share of every limit: the limit divided by the live
  processes Redis last counted (OUTBOX_PACING_FALLBACK_PROCESSES before any count was seen), a
  concurrency limit likewise (at least one slot). Never unlimited. The switch is one WARNING, the
  return one INFO (OutageReport); Redis is tried again at most every ``redis_retry_s`` (by one call:
  short, so the processes come back within that of each other, each still on its share meanwhile).

A switch either way lets the turns the other limiter handed out go first: those are at most
SHORT_WAIT_S ahead, so for SHORT_WAIT_S after Redis is found away the local limiter gives no rate
turn. Coming back, Redis gives none for SHORT_WAIT_S + ``redis_retry_s``: the process back first is
ahead of the others by up to ``redis_retry_s`` (each finds Redis back on its own next try; a try that
fails by timing out, not by a refused connection, adds its connect timeout), and each of them hands
out local turns, up to SHORT_WAIT_S ahead, until then. Longer than a call waits in its thread, so the
calls of the first ``redis_retry_s`` back go to the ledger until the pause ends, each held by the
target's rate (the scope the pause's floor names first), its reason naming the pause
(``_rate_why``). A pause of 1-1.5 s per outage, instead of the two limiters' turns adding up (the
first process back at the whole rate beside the others on their shares sent 2 x 20 + 4 in a 2 s
window of a 20/s limit in a CI run). Concurrency slots held in Redis when it goes away are not known
locally: until those calls end, a process may have its share in flight on top of them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from redis.exceptions import RedisError

from breaker.registry import connect
from workers.ground import metrics
from workers.ground.outage import OutageReport
from workers.pacing.limits import SHARE_HORIZON_S, Ask, LimitKind, PaceDecision, TargetLimits
from workers.pacing.local import LocalPacing
from workers.pacing.shared import Reading, RedisPacing

log = logging.getLogger(__name__)

# Redis errors surface as RedisError; OSError covers a socket error that slips through.
_STORAGE_ERRORS = (RedisError, OSError)

# The longest a call waits for a limit in its own thread: short enough that a backlog waits in the
# ledger (where it is visible and fair), long enough that a call one turn behind never pays a trip
# through the ledger (a claim and a finalize) to wait 50 ms.
SHORT_WAIT_S = 1.0
assert SHARE_HORIZON_S < SHORT_WAIT_S  # a tenant behind another's turns ahead waits for them in its thread
# A concurrency slot is leased for the call's timeouts plus this: the finalize after the answer
# needs no slot, but a call's answer may come a little after its read timeout.
SLOT_MARGIN_S = 2.0
# A call that finds every slot taken looks again this often while it may wait in its thread
# (each look is one round trip), then goes back to the ledger for SLOTS_RETRY_S (plus jitter).
SLOT_POLL_S = 0.05
SLOTS_RETRY_S = 0.5
# A call sent back for a rate returns at its place in the queue of calls sent back (shared.py), plus
# up to this share of the wait: the queue spreads a backlog at the rate; the jitter only keeps
# processes' returns from landing on the same instant.
RATE_RETRY_JITTER = 0.05


@dataclass(frozen=True)
class Cleared:
    """The call may go (the pacer already slept ``waited_s``). ``holder``: its concurrency slot,
    given back by ``Pacer.done``. ``waited_for``: the limit it waited for, if it waited."""

    target: str
    holder: str | None = None
    storage: Literal["redis", "local"] = "local"
    waited_s: float = 0.0
    waited_for: str | None = None

    def note(self) -> str | None:
        """What people read in the attempt's event (``ops show``): None if it went at once."""
        if not self.waited_for or self.waited_s <= 0:
            return None
        return f"waited {self.waited_s:.3f}s for the {self.waited_for}"


@dataclass(frozen=True)
class Deferred:
    """Not now: the call was not sent; the operation waits ``wait_s`` in the ledger. ``why`` says
    which limit ("rate limit of target payments: 50/s")."""

    target: str
    limit: LimitKind
    wait_s: float
    why: str


class Pacer:
    """This process's view of every target's limits (one per worker process)."""

    def __init__(
        self,
        limits: Mapping[str, TargetLimits],
        *,
        process_id: str,
        redis_url: str | None = None,
        namespace: str = "default",
        fallback_processes: int = 4,
        redis_retry_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.limits = dict(limits)
        self._sleep, self._clock, self._rng = sleep, clock, rng
        self._local = LocalPacing(clock)
        self._client = connect(redis_url) if redis_url and self.limits else None
        self._shared = RedisPacing(self._client, namespace, process_id) if self._client is not None else None
        self._fallback_processes = max(1, fallback_processes)
        self._seen_live: int | None = None
        self._redis_retry_s = redis_retry_s
        self._return_hold_s = SHORT_WAIT_S + redis_retry_s
        self._mode_lock = threading.Lock()
        self._degraded = False
        self._next_try = 0.0
        self._back_at = float("-inf")  # when Redis last came back (see _asking)
        self._outage = OutageReport(log, "pacing: limits storage (Redis)", quiet_s=0.0, clock=clock)

    # -- the call path -----------------------------------------------------------------------
    def clear(self, target: str, tenant: str, *, max_wait_s: float) -> Cleared | Deferred:
        """Whether a call of ``tenant`` to ``target`` may go now; it may sleep up to ``max_wait_s``
        (capped at SHORT_WAIT_S) first. A target without limits answers at once, asking nobody."""
        limits = self.limits.get(target)
        if limits is None:
            return Cleared(target)
        budget = max(0.0, min(max_wait_s, SHORT_WAIT_S))
        start = self._clock()
        holder = uuid.uuid4().hex if limits.max_in_flight is not None else None
        polled = False  # waited for a free slot
        while True:
            left = max(0.0, budget - (self._clock() - start))
            decision, storage, pause_s = self._ask(limits, tenant, holder or "", left)
            if decision.go:
                if decision.wait_s > 0:
                    self._sleep(decision.wait_s)
                waited = self._clock() - start
                held: tuple[LimitKind, str] | None = None
                if decision.scope is not None and decision.wait_s > 0:
                    held = ("rate", _rate_why(decision.scope.why(), pause_s))
                elif polled:
                    held = ("concurrency", limits.concurrency_why())
                if held is not None:
                    metrics.record_limit_wait(target, held[0], waited)
                return Cleared(target, holder, storage, waited if held else 0.0, held[1] if held else None)
            if decision.limit == "rate":
                assert decision.scope is not None
                wait = decision.wait_s * (1 + RATE_RETRY_JITTER * self._rng())
                return Deferred(target, "rate", wait, _rate_why(decision.scope.why(), pause_s))
            if self._clock() - start + SLOT_POLL_S > budget:
                return Deferred(target, "concurrency", SLOTS_RETRY_S * (1 + self._rng()), limits.concurrency_why())
            self._sleep(SLOT_POLL_S)
            polled = True

    def done(self, cleared: Cleared) -> None:
        """The call is over (answered, failed or never sent): its concurrency slot is free."""
        if cleared.holder is None:
            return
        if cleared.storage == "redis" and self._shared is not None:
            try:
                self._shared.release(cleared.target, cleared.holder)
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)  # the slot's lease ends on its own
            return
        self._local.release(cleared.target, cleared.holder)

    # -- operators ---------------------------------------------------------------------------
    def reading(self, target: str) -> Reading | None:
        """Calls admitted in the last second and slots held, as the fleet counts them (None: not
        shared, or Redis unreadable)."""
        if self._shared is None or target not in self.limits:
            return None
        try:
            return self._shared.reading(target)
        except _STORAGE_ERRORS:
            return None

    @property
    def degraded(self) -> bool:
        return self._degraded

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- internals ---------------------------------------------------------------------------
    def _ask(
        self, limits: TargetLimits, tenant: str, holder: str, max_wait_s: float
    ) -> tuple[PaceDecision, Literal["redis", "local"], float]:
        """The decision, where it was asked, and the pause after Redis came back still ahead then."""
        if self._shared is not None and self._use_shared():
            try:
                # Coming back (or just back): the local turns handed out go first, this process's and
                # those of the others still on their shares (module docstring).
                back_at = self._clock() if self._degraded else self._back_at
                ask = self._asking(limits, tenant, holder, max_wait_s, 1)
                ask = replace(ask, not_before_s=max(0.0, back_at + self._return_hold_s - self._clock()))
                decision = self._shared.acquire(ask)
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)
            else:
                self._seen_live = decision.live or self._seen_live
                self._leave_degraded()
                return decision, "redis", ask.not_before_s
        return self._local.acquire(self._asking(limits, tenant, holder, max_wait_s, self._share())), "local", 0.0

    def _asking(self, limits: TargetLimits, tenant: str, holder: str, max_wait_s: float, share: int) -> Ask:
        scopes = limits.scopes_for(tenant)
        if share > 1:
            scopes = [scope.shared_by(share) for scope in scopes]
        lease = max_wait_s + limits.call_s + SLOT_MARGIN_S
        return Ask(limits.target, scopes, limits.slots(share), holder, max_wait_s, lease, tenant=tenant)

    def _share(self) -> int:
        """How many processes this one shares each limit with, without a common counter."""
        if self._shared is None:
            return 1
        return self._seen_live or self._fallback_processes

    def _use_shared(self) -> bool:
        if not self._degraded:
            return True
        with self._mode_lock:  # degraded: one caller per redis_retry_s finds out whether Redis is back
            now = self._clock()
            if now < self._next_try:
                return False
            self._next_try = now + self._redis_retry_s
            return True

    def _enter_degraded(self, exc: BaseException) -> None:
        with self._mode_lock:
            self._next_try = self._clock() + self._redis_retry_s
            first = not self._degraded
            if first:
                self._degraded = True
                self._local.forget(SHORT_WAIT_S)
        if first:
            metrics.record_pacing_fallback(True)
            share = self._share()
            self._outage.failed(
                exc,
                "pacing: limits storage unreachable; each process keeps to 1/%d of every limit until it is back",
                share,
            )
        else:
            self._outage.failed(exc, "pacing: limits storage still unreachable")

    def _leave_degraded(self) -> None:
        if not self._degraded:
            return
        with self._mode_lock:
            if not self._degraded:
                return
            self._degraded = False
            self._back_at = self._clock()
        metrics.record_pacing_fallback(False)
        self._outage.succeeded()


def _rate_why(why: str, pause_s: float) -> str:
    """A rate's reason, naming the pause after Redis came back when the call met one."""
    if pause_s <= 0:
        return why
    return f"{why} (Redis is back from an outage: its first turns come {pause_s:.1f}s later)"
