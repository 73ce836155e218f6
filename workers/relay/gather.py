"""How the relay gathers notified ids into doorbells (the NOTIFY path of loop.py).

An id is published at once if nothing was published in the last ``linger_s``; otherwise it waits
for the end of that window with the ids that arrive meanwhile (or until a full doorbell's worth),
so a burst costs one broker message per batch, not one per commit.

While every worker process is busy (a doorbell of this ledger waits in the broker: with a prefetch
of one, a free process would have taken it), ids are held up to ``busy_linger_s`` more, until a
full doorbell's worth or a process frees up: a doorbell published then would only queue behind the
others, and one that carries more ids costs fewer claims, finalizes and messages per operation. So
slow arrivals no longer mean one-id doorbells when the workers are the bottleneck. While a worker is free nothing waits longer than before, but for one
recheck (``recheck_s``) when the depth was read just after a publish, before a worker took it.
"""

from __future__ import annotations

from collections.abc import Callable


class Gather:
    def __init__(
        self, *, batch: int, linger_s: float, busy_linger_s: float, recheck_s: float, busy: Callable[[], bool]
    ) -> None:
        """``busy``: whether every worker is busy now (a doorbell waits in the broker); asked at
        most every ``recheck_s`` while ids are held for it."""
        self.batch, self.linger_s, self.busy_linger_s, self.recheck_s = batch, linger_s, busy_linger_s, recheck_s
        self._busy = busy
        self.pending: list[str] = []
        self._since = 0.0  # when the first pending id arrived
        self._last_publish = float("-inf")

    def add(self, ids: list[str], now: float) -> None:
        if ids and not self.pending:
            self._since = now
        self.pending += ids

    def hold_s(self, now: float) -> float:
        """How much longer the pending ids wait (<= 0: publish now)."""
        if not self.pending or len(self.pending) >= self.batch:
            return 0.0
        window = self._last_publish + self.linger_s - now
        if window > 0:
            return window
        held = self._since + self.busy_linger_s - now
        if held <= 0 or not self._busy():
            return 0.0
        return min(held, self.recheck_s)

    def take(self, now: float) -> list[str]:
        """The pending ids, to publish now."""
        ids, self.pending, self._last_publish = self.pending, [], now
        return ids
