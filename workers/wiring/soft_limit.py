"""A soft time limit's signal acts only on the task it was armed for (celery#2952).

Celery's parent process sends SIGUSR1 to a pool process when a task's soft limit runs out, unless it
has read the task's result by then. While it reconnects to the broker (2 s and more per attempt) it
reads none, so when it comes back it sends the signals of tasks that ended meanwhile: to a process
that is idle, that runs a later task, or that is leaving because Celery cancelled its task on the
connection loss (SIGTERM; ``worker_cancel_long_running_tasks_on_connection_loss``). Billiard's own
handler raises SoftTimeLimitExceeded wherever the signal lands: an idle process ends ("Pool process
... error: SoftTimeLimitExceeded()" at ERROR, and its calls in flight go to lease expiry and the
reconciler), a later task fails, and a leaving process stops draining its calls out
(worker_process_shutdown; "Signal handler ... raised", or "Exception during reset or similar" when
the signal lands in a connection's return to its pool).

``on_task_prerun`` puts this module's handler in billiard's place in a pool process, at its first
task (billiard sets its own after the process initializer has run). A signal raises only while a
task runs that has had at least ``HONOURED_FROM`` of its soft limit, in a process that is not
leaving; any other is stale. The handler only notes a stale one: logging from a signal handler can
re-enter a handler's stream or lock, so the notes are said at INFO at the next task's start or end
and when the process leaves (``say_ignored``).
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import billiard.common
from billiard.exceptions import SoftTimeLimitExceeded

log = logging.getLogger(__name__)

# A signal is honoured once the running task has had this share of its soft limit. The child sends
# its ACK before it starts the task and the parent arms the limit's timer when it reads that ACK, so
# a genuine signal can come up to that gap (the task's start-up here: milliseconds) before the limit
# is up as timed from task_prerun; a stale one comes at any moment of a later task.
HONOURED_FROM = 0.9
_NOTES_KEPT = 100


class SoftLimitGuard:
    """What this pool process runs now, and whether a soft-limit signal is for it."""

    def __init__(self, leaving: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._leaving = leaving
        self._clock = clock
        self._running: tuple[float, float | None] | None = None  # the outermost task: (started, limit)
        self._depth = 0  # a task run eagerly inside another has its own prerun and postrun
        self._ignored: collections.deque[str] = collections.deque(maxlen=_NOTES_KEPT)

    def task_started(self, soft_limit_s: float | None) -> None:
        self._depth += 1
        if self._depth == 1:
            self._running = (self._clock(), soft_limit_s)

    def task_ended(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._running = None

    def stale(self) -> str | None:
        """Why a soft-limit signal arriving now is not for the running task, or None when it is."""
        if self._leaving():
            return "the process is leaving (Celery stopped it)"
        if self._running is None:
            return "no task is running"
        started, limit_s = self._running
        ran_s = self._clock() - started
        if limit_s is not None and ran_s < HONOURED_FROM * limit_s:
            return f"the running task began {ran_s:.2f}s ago and its soft limit is {limit_s:g}s"
        return None

    def on_signal(self, signum: int, frame: Any) -> None:
        if (why := self.stale()) is None:
            raise SoftTimeLimitExceeded()
        self._ignored.append(why)  # said later (say_ignored): no logging inside a signal handler

    def say_ignored(self) -> None:
        while self._ignored:
            log.info("soft time limit signal ignored, armed for a task that has ended: %s", self._ignored.popleft())


def leaving() -> bool:
    """Has billiard's SIGTERM handler run in this process (it is on its way out)?"""
    fired = getattr(billiard.common, "terminate_handler_fired", None)  # newer billiard
    if fired is not None:
        return bool(fired())
    flag = getattr(billiard.common, "_should_have_exited", None)
    return bool(flag and flag[0])


_guard = SoftLimitGuard(leaving)


def _soft_limit_of(task: Any) -> float | None:
    """The soft limit this run of ``task`` has: the message's, the task's, or the app's."""
    timelimit = getattr(task.request, "timelimit", None) or (None, None)
    limit = timelimit[1] or getattr(task, "soft_time_limit", None) or task.app.conf.task_soft_time_limit
    return float(limit) if limit else None


def on_task_prerun(task: Any = None, **_: object) -> None:
    """Celery ``task_prerun``: the guard's handler in place (in a pool process), the task started."""
    if threading.current_thread() is not threading.main_thread():
        return  # a threads pool: no signals, no soft limits
    from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler

    if SIG_SOFT_TIMEOUT is None:
        return
    current = signal.getsignal(SIG_SOFT_TIMEOUT)
    if current is soft_timeout_sighandler:
        signal.signal(SIG_SOFT_TIMEOUT, _guard.on_signal)
    elif current != _guard.on_signal:  # a bound method: equal, not identical, to the one installed
        return  # not a billiard pool process (solo: Celery's own SIGUSR1 handler, no soft limits)
    try:
        limit_s = _soft_limit_of(task) if task is not None else None
    except Exception:  # noqa: BLE001 - a limit we cannot read is honoured whenever it comes
        limit_s = None
    _guard.task_started(limit_s)
    _guard.say_ignored()


def on_task_postrun(**_: object) -> None:
    """Celery ``task_postrun`` (also after a task that raised): nothing runs now."""
    _guard.task_ended()
    _guard.say_ignored()


def on_process_shutdown() -> None:
    """The pool process leaves: what it ignored is said before it goes."""
    _guard.say_ignored()
