"""In flight: a worker process's claimed work (dispatch's calls, the reconciler's lookups), run off
the doorbell task's thread, so a slow provider holds only itself.

A doorbell task claims, hands its claims here and returns: the process takes its next doorbell
while the work is out. The machine, the same for calls and lookups:

- **lanes**: a doorbell's claims to one target run on one pool thread, one after another: a fast
  target needs nothing more (a thread per call costs more CPU than such a call waits, and splits
  a doorbell's results into more transactions). A policy may spread a lane at start (a thread
  per claim: the reconciler's slow lookups);
- **the watchdog**: a claim still running after HANDOFF_S gives the claims queued behind it in its
  lane a pool thread each, so one 1.5 s timeout holds one operation, not the nine behind it
  (unless the policy keeps the target to one at a time: dispatch's suspect targets);
- **the committer**: results go to one committer thread, which commits whatever has arrived in one
  transaction (the work's ``commit``, on its own connection);
- **room**: at most ``max_ops`` operations claimed and not yet committed per process (room.py: a
  doorbell task waits for one place before it claims, and claims as many as fit).

What differs is the work (``Work``): how one claim is run (dispatch: the call, with its canary
policy; reconcile: the lookup, with its latency average) and how results are committed.

A crash loses nothing: every claimed operation holds a lease, which brings it back once expired.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from breaker import Admissions
from outbox.ledger.claims import Claim
from workers.engine.room import Room

log = logging.getLogger(__name__)

# A claim running longer than this gives away the claims queued behind it. Well above a healthy
# call to a nearby provider (a few milliseconds), well below any read timeout.
HANDOFF_S = 0.05
WATCH_EVERY_S = 0.02

R = TypeVar("R")  # what running one claim gives (dispatch: Attempted; reconcile: Asked)
V = TypeVar("V")  # what committing it makes of it, per operation id (an outcome, a verdict)


@dataclass
class Batch(Generic[R, V]):
    """One doorbell's claims on their way: done when every one is committed. ``context``: what the
    work needs of the doorbell besides its admissions (dispatch: its send checks; reconcile: its rng)."""

    admissions: Admissions
    context: Any
    waiting: int
    results: dict[str, V] = field(default_factory=dict)
    done: Future[dict[str, V]] = field(default_factory=Future)


@dataclass(eq=False)  # a lane is itself: held in a set while it runs
class Lane(Generic[R, V]):
    """Claims of one doorbell to one target, run in turn on one pool thread."""

    batch: Batch[R, V]
    target: str | None
    todo: deque[Claim]
    running_since: float | None = None
    finished: list[R] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Work(Protocol[R, V]):
    """What the pool runs and commits: dispatch's calls or the reconciler's lookups."""

    def target_of(self, claim: Claim) -> str | None:
        """The lane a claim joins (its target; None: an action not in the actions file)."""

    def spread(self, target: str | None) -> bool:
        """A thread per claim from the start (True), or one lane per target (False)."""

    def may_hand_off(self, target: str | None) -> bool:
        """Whether the watchdog may give a slow lane's queued claims threads of their own."""

    def run(self, lane: Lane[R, V], claim: Claim) -> R:
        """Run one claim (a call, a lookup); never raises."""

    def claim_of(self, result: R) -> Claim: ...

    def commit(self, results: list[tuple[Batch[R, V], R]]) -> dict[str, V]:
        """Write what has arrived in one transaction; what each operation came to. An operation
        missing from the answer gets ``unwritten``'s."""

    def unwritten(self, result: R) -> V | None:
        """What a result not written by ``commit`` (an outage, a bug) tells its doorbell (None: nothing)."""


class InFlightPool(Generic[R, V]):
    def __init__(self, work: Work[R, V], *, max_ops: int, name: str, record: Callable[[int], None]) -> None:
        """``name``: the threads' (``call``, ``lookup``); ``record``: the gauge of what is held."""
        self._work = work
        self._name = name
        self.max_ops = max_ops
        self._pool = ThreadPoolExecutor(max_workers=max_ops, thread_name_prefix=name)
        # Reserved or claimed here, not yet committed.
        self.room = Room(max_ops, record)
        self._lanes: set[Lane[R, V]] = set()
        self._lanes_lock = threading.Lock()
        self._results: queue.SimpleQueue[tuple[Batch[R, V], list[R]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._committer = threading.Thread(target=self._commit_loop, name=f"{name}-commit", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_loop, name=f"{name}-watchdog", daemon=True)
        self._committer.start()
        self._watchdog.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- running ----------------------------------------------------------------------------
    def start(
        self, claims: Sequence[Claim], admissions: Admissions, context: Any, ready: Sequence[R] = ()
    ) -> Future[dict[str, V]]:
        """Run each claim (already reserved); ``ready``: results had without running (committed with
        the rest). The future holds what each came to once all are committed."""
        batch: Batch[R, V] = Batch(admissions, context, waiting=len(claims) + len(ready))
        if not batch.waiting:
            batch.done.set_result({})
            return batch.done
        if ready:
            self._results.put((batch, list(ready)))
        lanes: dict[str | None, deque[Claim]] = {}
        for claim in claims:
            lanes.setdefault(self._work.target_of(claim), deque()).append(claim)
        for target, todo in lanes.items():
            if self._work.spread(target):
                for claim in todo:
                    self._submit(Lane(batch, target, deque([claim])))
            else:
                self._submit(Lane(batch, target, todo))
        return batch.done

    def _submit(self, lane: Lane[R, V]) -> None:
        with self._lanes_lock:
            self._lanes.add(lane)
        self._pool.submit(self._run, lane)

    def _run(self, lane: Lane[R, V]) -> None:
        try:
            while True:
                with lane.lock:
                    if not lane.todo:
                        break
                    claim = lane.todo.popleft()
                    lane.running_since = time.monotonic()
                result = self._work.run(lane, claim)
                with lane.lock:
                    lane.running_since = None
                    lane.finished.append(result)
        finally:
            with self._lanes_lock:
                self._lanes.discard(lane)
            with lane.lock:
                finished, lane.finished = lane.finished, []
            if finished:
                self._results.put((lane.batch, finished))

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            now = time.monotonic()
            with self._lanes_lock:
                lanes = list(self._lanes)
            for lane in lanes:
                self._hand_off_if_slow(lane, now)

    def _hand_off_if_slow(self, lane: Lane[R, V], now: float) -> None:
        if not self._work.may_hand_off(lane.target):
            return
        with lane.lock:
            slow = lane.running_since is not None and now - lane.running_since > HANDOFF_S
            if not slow or not lane.todo:
                return
            todo, lane.todo = list(lane.todo), deque()
            finished, lane.finished = lane.finished, []
        # What the slow claim held up: committed now, and the rest run beside it.
        if finished:
            self._results.put((lane.batch, finished))
        for claim in todo:
            self._submit(Lane(lane.batch, lane.target, deque([claim])))

    # -- committing -------------------------------------------------------------------------
    def _commit_loop(self) -> None:
        while True:
            item = self._results.get()
            if item is None:
                return
            items = [item]
            while True:  # whatever else has arrived goes into the same transaction
                try:
                    more = self._results.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._results.put(None)
                    break
                items.append(more)
            try:
                self._commit([(batch, result) for batch, results in items for result in results])
            except Exception:  # noqa: BLE001 - a bug: logged; the committer must outlive it, or nothing commits again
                log.exception("%s committer: unexpected error after a commit", self._name)

    def _commit(self, arrived: list[tuple[Batch[R, V], R]]) -> None:
        written: dict[str, V] = {}
        try:
            written = self._work.commit(arrived)
        except Exception:  # noqa: BLE001 - a bug: logged; the thread must outlive it
            log.exception(
                "%s committer: unexpected error; the operations concerned come back through their leases",
                self._name,
                extra={"operation_ids": [self._work.claim_of(r).operation_id for _, r in arrived]},
            )
        finally:
            self.room.give_back(len(arrived))  # first: nothing below may keep the room taken
            for batch, result in arrived:
                operation_id = self._work.claim_of(result).operation_id
                value = written.get(operation_id)
                if value is None:
                    value = self._work.unwritten(result)
                if value is not None:
                    batch.results[operation_id] = value
                batch.waiting -= 1
                if batch.waiting == 0:
                    self._complete(batch)

    def _complete(self, batch: Batch[R, V]) -> None:
        """A doorbell's every claim committed: its breakers told, its future done, whatever the
        telling raises (one batch's trouble must not leave another's future unfinished)."""
        try:
            batch.admissions.tell_successes()
        except Exception:  # noqa: BLE001 - the breakers' own outage handling failed: logged, the batch still ends
            log.exception("%s committer: telling the breakers a doorbell's successes failed", self._name)
        finally:
            batch.done.set_result(batch.results)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Let the work out finish and be committed (up to ``timeout_s``), then stop."""
        self.room.close()  # first: no new claims while the ones out drain
        if held := self.room.wait_empty(timeout_s):
            log.warning("%d %s(s) still in flight at shutdown: their leases bring them back", held, self._name)
        self._stop.set()
        self._results.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._committer.join(timeout=5)
        self._watchdog.join(timeout=1)
