"""Task events out of a worker's call threads, through Celery's own event protocol, off the hot path.

A doorbell task returns in milliseconds; the calls it claimed run on the process's call and lookup
threads (workers/dispatch/in_flight.py, workers/reconcile/in_flight.py). Their task events
(call_events.py says what they are) leave from here, as a Celery worker's own leave:

- **only while the worker sends task events**: ``-E`` / ``worker_send_task_events``
  (OUTBOX_TASK_EVENTS), or Flower's ``enable_events`` (Flower asks every few seconds). The switch is
  the worker's main process's event dispatcher (its ``task`` group); a consumer step copies it
  every SYNC_EVERY_S into one byte of memory shared with the pool processes forked after it
  (``on()``: one memory read on the hot path, all that events cost while they are off);
- **from one thread per process**: a call thread appends the event to a bounded queue and goes
  on; the sender thread hands whatever has queued to a ``celery.events.Dispatcher`` of its own
  (hostname: the worker's node name, so Flower files the events under that worker) buffering the
  ``task`` group, as the worker's own dispatcher buffers its events, and publishes the batch as one
  ``task.multi`` message every FLUSH_EVERY_S (at once after a ``task-retried``). Every consumer of
  Celery events (Flower, ``celery events``, an EventReceiver) reads such batches;
- **events are monitoring**: while the broker is away they are dropped (one WARNING per outage,
  with how many), never held without bound nor retried on a call's thread.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import time
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)

# How often the sender publishes what has queued: a call's events reach Flower this much later at
# most (a person does not see 0.2 s), and a busy process publishes one message per interval instead
# of one per event: a publish costs about as much as 20 events in it.
FLUSH_EVERY_S = 0.2
# How often the main process copies its dispatcher's switch to the pool (Flower's enable_events
# comes every 5 s: a second more is not noticed).
SYNC_EVERY_S = 1.0
# Events waiting for the sender, per process: a broker that does not answer must not grow memory.
# 20 000 events are ~6 000 calls, minutes of a busy process's events.
MAX_QUEUED = 20_000
# Events per published message (one LPUSH per bound queue on Redis): a backlog goes in pieces.
BATCH = 500
# After a failed publish the sender waits this long before it connects again.
RECONNECT_AFTER_S = 2.0

_switch: mmap.mmap | None = None  # one shared byte: 1 while the worker sends task events
_hostname: str | None = None
_app: Any = None
_sender: _Sender | None = None
_sender_lock = threading.Lock()


def on() -> bool:
    """Whether this process's worker sends task events now (False outside a worker)."""
    switch = _switch
    return switch is not None and switch[0] == 1


def install(app: Any, hostname: str, task_events: bool) -> None:
    """In the worker's main process, before its pool forks (worker_init): the shared switch,
    set from ``-E`` / ``worker_send_task_events``; TaskEventsSwitch keeps it in step after."""
    global _switch, _hostname, _app
    # MAP_SHARED | MAP_ANONYMOUS: the pool processes forked after this see the parent's writes.
    _switch = mmap.mmap(-1, 1)
    _hostname, _app = hostname, app
    set_on(task_events)


def set_on(value: bool) -> None:
    if _switch is not None:
        _switch[0] = 1 if value else 0


def on_worker_init(sender: Any = None, **_: Any) -> None:
    """celery.signals.worker_init: ``sender`` is the WorkController (its node name, its -E)."""
    if sender is not None:
        install(sender.app, sender.hostname, bool(sender.task_events))


class TaskEventsSwitch(bootsteps.StartStopStep):  # type: ignore[misc]
    """A consumer step: the worker's dispatcher decides (``-E``, enable_events, disable_events);
    the pool's processes follow it."""

    requires = {"celery.worker.consumer.events:Events"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.entry: Any = None

    def start(self, parent: Any) -> None:
        self.sync(parent)
        self.entry = parent.timer.call_repeatedly(SYNC_EVERY_S, self.sync, (parent,))

    def stop(self, parent: Any) -> None:
        if self.entry is not None:
            self.entry.cancel()
            self.entry = None

    @staticmethod
    def sync(parent: Any) -> None:
        dispatcher = parent.event_dispatcher
        if dispatcher is None:
            return  # reconnecting: the switch stays as it was
        # No groups: every group (-E); else the task group must be named (enable_events adds it).
        set_on(bool(dispatcher.enabled and (not dispatcher.groups or "task" in dispatcher.groups)))


def send(type_: str, fields: dict[str, Any]) -> None:
    """Queue one task event (``fields`` carries its ``timestamp``) for this process's sender.

    A ``task-retried`` wakes the sender at once: the next attempt may be another process's, and
    Celery's event state (Flower's) applies a RETRY over any state, even one that came before it;
    so it must leave before the next attempt's events can, not up to FLUSH_EVERY_S later."""
    sender = _sender
    if sender is None or sender.pid != os.getpid():
        sender = _start_sender()
    sender.put(type_, fields)
    if type_ == "task-retried":
        sender.wake.set()


def flush() -> None:
    """Publish what has queued now (tests, and a process that stops)."""
    if _sender is not None and _sender.pid == os.getpid():
        _sender.flush()


def _start_sender() -> _Sender:
    global _sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid():  # a forked child starts its own
            _sender = _Sender(_app, _hostname)
        return _sender


class _Sender:
    def __init__(self, app: Any, hostname: str | None) -> None:
        if app is None:
            from celery import current_app

            app = current_app
        self.app = app
        self.hostname = hostname
        self.pid = os.getpid()
        self.queued: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=MAX_QUEUED)
        self.dropped = 0
        self._dispatcher: Any = None
        self._connection: Any = None
        self._down_since: float | None = None
        self._lock = threading.Lock()  # one flush at a time (the thread's, or flush())
        self.wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="task-events", daemon=True)
        self._thread.start()

    def put(self, type_: str, fields: dict[str, Any]) -> None:
        if len(self.queued) >= MAX_QUEUED:
            self.dropped += 1  # the deque drops the oldest: said with the next outage's WARNING
        self.queued.append((type_, fields))

    def _run(self) -> None:
        while True:
            self.wake.wait(FLUSH_EVERY_S)
            self.wake.clear()
            if self.queued:
                try:
                    self.flush()
                except Exception:  # noqa: BLE001 - monitoring must never end the thread
                    log.warning("task events: unexpected error while sending", exc_info=True)

    def flush(self) -> None:
        with self._lock:
            while self.queued:
                batch: list[tuple[str, dict[str, Any]]] = []
                while self.queued and len(batch) < BATCH:
                    batch.append(self.queued.popleft())
                self._publish(batch)

    def _publish(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        if self._down_since is not None and time.monotonic() - self._down_since < RECONNECT_AFTER_S:
            self.dropped += len(batch)
            return
        try:
            dispatcher = self._dispatcher or self._open()
            for type_, fields in batch:
                dispatcher.send(type_, **fields)
            dispatcher.flush(errors=False)  # the task group's buffer, as one task.multi message
        except Exception as exc:  # noqa: BLE001 - the broker away: these events are lost, the calls are not
            self._close()
            self.dropped += len(batch)
            if self._down_since is None:
                log.warning(
                    "task events not sent (%s: %s): Flower misses them until the broker answers again",
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
                )
            self._down_since = time.monotonic()
            return
        if self._down_since is not None or self.dropped:
            log.info("task events sent again; %d event(s) were dropped meanwhile", self.dropped)
            self._down_since, self.dropped = None, 0

    def _open(self) -> Any:
        connection = self.app.connection_for_write()
        try:
            connection.connect()  # once: a broker that does not answer is the next flush's business
            dispatcher = self.app.events.Dispatcher(
                connection,
                hostname=self.hostname,
                enabled=True,
                groups=["task"],
                buffer_group=["task"],
                buffer_limit=BATCH + 1,
                buffer_while_offline=False,
            )
        except BaseException:
            connection.release()
            raise
        self._connection, self._dispatcher = connection, dispatcher
        return dispatcher

    def _close(self) -> None:
        connection, self._connection, self._dispatcher = self._connection, None, None
        if connection is not None:
            try:
                connection.release()
            except Exception:  # noqa: BLE001, S110 - closing a connection that already broke
                pass
