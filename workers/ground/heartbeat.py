"""Liveness for the processes that serve no HTTP: the relay, Celery workers (dispatch and
reconciler) and beat touch a file from their own loop, and ``agent-outbox health --heartbeat``
(a Kubernetes exec probe, a compose healthcheck) says whether it is fresh.

The beat comes from the loop that does the work, not from a side thread: a relay whose loop
hangs, a worker whose event loop is stuck, a beat that stopped ticking all go stale, while a
process that is only waiting out a database or broker outage keeps beating (it handles the outage
itself; restarting it would not help). ``OUTBOX_HEARTBEAT_FILE`` unset: no file, nothing to do.

Celery: a consumer bootstep puts a repeating entry on the consumer's timer (in a prefork worker it
runs in the worker's event loop); beat: a scheduler whose tick beats (celery_steps.py). This module
imports nothing of Celery: the probe runs it every few seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "OUTBOX_HEARTBEAT_FILE"
# Touched at most this often; a probe's --max-age should be several times the slowest beat
# (relay: its poll; worker: EVERY_S; beat: its tick, at most beat_max_loop_interval).
EVERY_S = 2.0


class Heartbeat:
    def __init__(self, path: str | os.PathLike[str] | None, every_s: float = 1.0) -> None:
        self.path = Path(path) if path else None
        self.every_s = every_s
        self._last = float("-inf")

    @classmethod
    def from_env(cls, every_s: float = 1.0) -> Heartbeat:
        return cls(os.environ.get(ENV) or None, every_s)

    def beat(self) -> None:
        """Touch the file (at most once every ``every_s``); never raises: a full disk must not
        stop the work, the probe then says the file is stale."""
        now = time.monotonic()
        if self.path is None or now - self._last < self.every_s:
            return
        self._last = now
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
            os.utime(self.path)
        except OSError:
            pass


def age_s(path: str | os.PathLike[str]) -> float | None:
    """Seconds since ``path`` was last touched; None if there is no such file."""
    try:
        return max(time.time() - Path(path).stat().st_mtime, 0.0)
    except FileNotFoundError:
        return None
