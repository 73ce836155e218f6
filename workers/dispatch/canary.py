"""Canaries: how many calls a worker process lets out at once to a target it has reason to doubt.

A suspect target gets one call at a time from the whole process, each asking the breaker first (a
canary): at start, and after a quarter of its breaker's fail_max failures in a row seen by this
process, until a call answers well. So a process never piles its calls in flight onto a target that
is going down (with fail_max 3 the breaker opens after 3 failures plus at most one call in flight
per other process), while a target that fails some calls and answers others (a provider that
faults a share of first requests) keeps its calls overlapping: serializing on every failure would
put each read timeout back in front of the calls behind it.

Successes are told to the breaker soon, not at the doorbell's end (``tell_success_soon``).
"""

from __future__ import annotations

import threading
import time

from breaker import Admissions
from outbox.ledger.states import AttemptClass
from outbox.ledger.transitions import AttemptReport
from workers.provider.actions import ActionsFile

# A target's successes are told to its breaker at most this often per process (see
# tell_success_soon): each telling is a Redis round trip.
SUCCESS_EVERY_S = 0.05


class Canaries:
    def __init__(self, actions: ActionsFile) -> None:
        self._actions = actions
        # Counted failures in a row per target, as seen by this process (absent: no answer yet).
        self._failures: dict[str, int] = {}
        self._failed_since: dict[str, bool] = {}  # a failure seen here since the last success told
        self._success_told: dict[str, float] = {}  # when a success was last told to the breaker
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def suspect(self, target: str | None) -> bool:
        if target is None:
            return False
        seen = self._failures.get(target)
        if seen is None:
            return True
        known = self._actions.targets.get(target)
        return seen >= max(1, -(-known.breaker.fail_max // 4)) if known is not None else seen > 0

    def learn(self, target: str, report: AttemptReport) -> None:
        if report.klass in (AttemptClass.SUCCEEDED, AttemptClass.REJECTED):
            self._failures[target] = 0
        elif report.klass is not AttemptClass.NOT_SENT or report.latency_s is not None:
            # Not sent without a call (breaker open, budget spent) says nothing about the target;
            # a refused connection does.
            self._failures[target] = self._failures.get(target, 0) + 1
            self._failed_since[target] = True

    def lock(self, target: str) -> threading.Lock:
        """The one-at-a-time lock of a suspect target."""
        with self._locks_lock:
            return self._locks.setdefault(target, threading.Lock())

    def tell_success_soon(self, admissions: Admissions, target: str) -> None:
        """Tell the breaker about a success now if it may be counting failures in a row: right
        after a failure seen here, else at most every SUCCESS_EVERY_S per target. Held to the
        doorbell's end, successes let failures recorded meanwhile by every process run up to
        fail_max: a provider that fails a large share of first requests and answers the rest
        would have its breaker opened while it is healthy."""
        if not admissions.success_waiting(target):
            return
        now = time.monotonic()
        if not self._failed_since.get(target) and now - self._success_told.get(target, float("-inf")) < SUCCESS_EVERY_S:
            return
        if admissions.tell_success(target):
            self._failed_since[target] = False
            self._success_told[target] = now
