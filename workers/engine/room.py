"""Room in one worker process: at most ``max_ops`` operations claimed and not yet finalized (or
settled, for lookups) at once (OUTBOX_MAX_IN_FLIGHT). Shared by dispatch's calls (in_flight.py) and
the reconciler's lookups (workers/reconcile/in_flight.py).

A doorbell task takes room before it claims (backpressure: a full process takes no doorbells; the
broker holds them and the ledger holds the work). It waits for one place, not for a whole batch's:
waiting for a batch's room waited for the slowest call of the batch before, the process idle behind
one stall (capacity 41 -> 136 settled/s under the fault mix, measured by ``bench.overload``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Room:
    def __init__(self, max_ops: int, record: Callable[[int], None]) -> None:
        self.max_ops = max_ops
        self._record = record  # the gauge of what is held (metrics)
        self._cond = threading.Condition()
        self._held = 0
        self._closed = False

    @property
    def held(self) -> int:
        return self._held

    def take(self, n: int, *, timeout_s: float) -> int:
        """Wait until at least one more operation fits; take as many of ``n`` as fit then (all ``n``
        in an empty process). 0 on timeout or once closed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._closed and self._held and self._held >= self.max_ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    return 0
                self._cond.wait(left)
            if self._closed:
                return 0
            granted = min(n, self.max_ops - self._held) if self._held else n
            self._held += granted
            self._record(self._held)
        return granted

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
