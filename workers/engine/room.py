"""Room in one worker process: at most ``max_ops`` operations claimed and not yet finalized (or
settled, for lookups) at once (OUTBOX_MAX_IN_FLIGHT). Shared by dispatch's calls (in_flight.py) and
the reconciler's lookups (workers/reconcile/in_flight.py).

A doorbell task takes room before it claims (backpressure: a full process takes no doorbells; the
broker holds them and the ledger holds the work). It waits for one place, not for a whole batch's:
waiting for a batch's room waited for the slowest call of the batch before, the process idle behind
one stall (capacity 41 -> 136 settled/s under the fault mix, measured by ``bench.overload``).

Once one place is free it gathers for a moment (``gather_s``, 20 ms): while fewer than half the
room (or the doorbell's batch, if smaller) is free, it waits that long at most for more, then takes
what fits. On a starved CPU the committer finalizes a few calls at a time, and a doorbell that took
the first place freed claimed a handful: a claim statement, a finalize and a doorbell per handful,
the fixed costs per operation growing just when the CPU is short. Under a 0.8-CPU quota with
batches of 20, claims of 8-10 rows became 13-17, and the workers' CPU per operation fell 14-33%
(three pairs). Where a slow provider bounds the process, the moment costs a place or two idle for
20 ms per claim; a stalled call still holds only itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

GATHER_S = 0.02


class Room:
    def __init__(self, max_ops: int, record: Callable[[int], None], *, gather_s: float = GATHER_S) -> None:
        self.max_ops = max_ops
        self.gather_s = gather_s
        self._record = record  # the gauge of what is held (metrics)
        self._cond = threading.Condition()
        self._held = 0
        self._closed = False

    @property
    def held(self) -> int:
        return self._held

    def take(self, n: int, *, timeout_s: float) -> int:
        """Wait until at least one more operation fits, then gather (up to ``gather_s``) until half
        the room or ``n`` fits; take as many of ``n`` as fit then (all ``n`` in an empty process).
        0 on timeout or once closed."""
        deadline = time.monotonic() + timeout_s
        want = min(n, max(1, self.max_ops // 2))
        with self._cond:
            while True:
                if not self._wait(lambda: self._held < self.max_ops, deadline):
                    return 0
                self._wait(lambda: self.max_ops - self._held >= want, min(deadline, time.monotonic() + self.gather_s))
                if self._closed:
                    return 0
                if self._held < self.max_ops or not self._held:
                    break  # else another doorbell took the room while this one gathered: wait again
            granted = min(n, self.max_ops - self._held) if self._held else n
            self._held += granted
            self._record(self._held)
        return granted

    def _wait(self, fits: Callable[[], bool], until: float) -> bool:
        """With the lock held: wait until the process is empty, ``fits()`` or closed (True), or
        ``until`` passes (False)."""
        while not self._closed and self._held and not fits():
            left = until - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def give_back(self, n: int) -> None:
        if n:
            with self._cond:
                self._held -= n
                self._cond.notify_all()
                self._record(self._held)

    def close(self) -> None:
        """The process is stopping: no doorbell takes room any more (those waiting go with none);
        what is held is still given back as its calls end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_empty(self, timeout_s: float) -> int:
        """Wait (up to ``timeout_s``) until nothing is held; what is still held then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._held and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._held
