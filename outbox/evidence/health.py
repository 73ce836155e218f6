"""Whether a separate evidence store answers, known without a round trip per operation.

An action that requires evidence (``evidence: {required: true}``, or ``OUTBOX_EVIDENCE_REQUIRED``) is
not sent while the store (``OUTBOX_EVIDENCE_URL``) is down: fail closed. Asking the store before each
send would add a round trip to every dispatch. Instead each process keeps what it last saw of it:
every write to the store (a success's record, a backfill) says up or down as it happens, and when
what it knows is older than ``PROBE_EVERY_S`` the next question runs one cheap probe (``SELECT 1``).
So a busy process learns of an outage from its first failed write, and any process within
``PROBE_EVERY_S`` of asking; the cost is at most one probe per ``PROBE_EVERY_S`` per process, and only
while some claimed operation requires evidence. The window this leaves: a store that fails less than
``PROBE_EVERY_S`` after it last answered may still see one send, whose success is then recorded
``committed_evidence_degraded`` and backfilled (the effect is never lost, only its record late).

A change is logged once per process (WARNING when the store goes down, INFO when it is back: not
per operation) and told to ``on_change`` (the workers' gauge, workers/ground/metrics.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# What a process last saw of the store is trusted this long before it probes again: short enough that
# a store back up is used within a second, long enough that the probe is noise beside the sends.
PROBE_EVERY_S = 1.0


class SinkHealth:
    """What this process knows of one evidence store: up, down, or not seen yet (None)."""

    def __init__(
        self,
        probe: Callable[[], None],
        *,
        probe_every_s: float = PROBE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self._probe = probe
        self.probe_every_s = probe_every_s
        self._clock = clock
        self.on_change = on_change
        self._up: bool | None = None
        self._seen_at = -math.inf
        self._lock = threading.Lock()
        self._probing = threading.Lock()

    @property
    def up(self) -> bool | None:
        """The last answer, without asking (None: not seen yet)."""
        return self._up

    def saw(self, up: bool, error: BaseException | None = None) -> None:
        """Record what a write (or a probe) to the store just found; log and tell a change once."""
        with self._lock:
            changed = self._up is not up
            self._up, self._seen_at = up, self._clock()
        if not changed:
            return
        if up:
            log.info("evidence store answers again: operations that require evidence are sent")
        else:
            log.warning(
                "evidence store down (%s): operations whose action requires evidence wait, not sent, until it is "
                "back; the successes of other actions are recorded committed_evidence_degraded and backfilled",
                type(error).__name__ if error is not None else "no answer",
            )
        if self.on_change is not None:
            try:
                self.on_change(up)
            except Exception:  # noqa: BLE001 - a gauge must never decide whether we send
                log.debug("evidence store health hook failed", exc_info=True)

    def is_up(self) -> bool:
        """Whether the store answers, as far as this process knows now: the last write's or probe's
        answer while it is fresher than ``probe_every_s``, else one probe first. One thread probes at
        a time; the others take the last answer meanwhile (a store never seen counts as up: the probe
        under way, or the first write, says otherwise)."""
        if self._up is not None and self._clock() - self._seen_at < self.probe_every_s:
            return self._up
        if not self._probing.acquire(blocking=False):
            return self._up is not False
        try:
            try:
                self._probe()
            except Exception as exc:  # noqa: BLE001 - any failure to answer is "down"
                self.saw(False, exc)
            else:
                self.saw(True)
        finally:
            self._probing.release()
        return bool(self._up)
