"""Lookups in flight: a reconciler process's claimed lookups, run off the doorbell task's thread, so
the process's capacity is its room, not one provider round trip at a time.

A reconcile doorbell task claims (batch.py), hands its claims here and returns: the process
takes its next doorbell while the lookups are out. Here:

- a doorbell's lookups of one target run on one pool thread, one after another, while that
  target answers lookups within SPREAD_AFTER_S: a provider that answers in milliseconds needs
  nothing more (a thread per lookup costs more CPU per lookup than the hand-off saves, and splits
  a doorbell's settlements into more transactions), and the process's other
  doorbells run beside it;
- a target whose last lookups took longer gets a thread per lookup, all of a doorbell's at once;
  and a lookup still running after HANDOFF_S gives the lookups queued behind it threads of their
  own (the watchdog, as for dispatch's calls): one slow answer holds only itself;
- answers go to one settler thread, which judges whatever has arrived (one read of the dispatch
  attempts for all "not found" answers) and settles it in one transaction (verdicts.settle_all);
- room: at most ``max_ops`` operations claimed and not yet settled per process
  (OUTBOX_MAX_IN_FLIGHT; workers/dispatch/room.py: a doorbell task waits for one place before it
  claims, and claims as many as fit).

A crash loses nothing: every claimed operation holds the lookup's lease, and is claimed again once
it expires (its open lookup row stays as the record of a question never answered).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from breaker import Admissions
from outbox.ledger.claims import Claim
from outbox.ledger.states import Status
from workers.dispatch.fan_out import Downstream
from workers.dispatch.finalize import Recorder
from workers.dispatch.in_flight import HANDOFF_S, WATCH_EVERY_S
from workers.dispatch.room import Room
from workers.reconcile.judge import LookupVerdict
from workers.reconcile.lookup import Asked, LookupBudget, ask
from workers.reconcile.rechecks import settle_rechecks
from workers.reconcile.verdicts import settle_answers
from workers.relay.outage import OUTAGES
from workers.wiring import call_events, metrics

log = logging.getLogger(__name__)

# A target whose lookups take longer than this (a moving average, per process) gets a thread per
# lookup: waiting is then most of a lookup, and the hand-off to a thread (a fraction of a
# millisecond of CPU) is small beside it. A nearby provider answers in a few milliseconds, a
# provider's search endpoint in tens.
SPREAD_AFTER_S = 0.01
LATENCY_WEIGHT = 0.3  # of the newest lookup in the moving average


@dataclass
class _DoorbellLookups:
    """One doorbell's claims on their way: done when every one is settled."""

    admissions: Admissions
    rng: random.Random
    waiting: int
    verdicts: dict[str, LookupVerdict] = field(default_factory=dict)
    done: Future[dict[str, LookupVerdict]] = field(default_factory=Future)


@dataclass(eq=False)  # a job is itself: held in a set while it runs
class _LookupJob:
    """Lookups of one doorbell to one target, run in turn on one pool thread."""

    batch: _DoorbellLookups
    target: str
    todo: deque[Claim]
    running_since: float | None = None
    finished: list[Asked] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class LookupsInFlight:
    def __init__(
        self,
        downstream: Downstream,
        recorder: Recorder,
        budget: LookupBudget,
        *,
        max_ops: int,
        ledger: str | None = None,
    ) -> None:
        """``ledger``: the fleet's ledger these lookups belong to (OUTBOX_DATABASE_URLS), for the gauge."""
        self._downstream = downstream
        self.recorder = recorder
        self._budget = budget
        self.max_ops = max_ops
        self._pool = ThreadPoolExecutor(max_workers=max_ops, thread_name_prefix="lookup")
        # Reserved or claimed, not yet settled.
        self.room = Room(max_ops, lambda held: metrics.record_lookups_in_flight(held, ledger))
        self._answers: queue.SimpleQueue[tuple[_DoorbellLookups, list[Asked]] | None] = queue.SimpleQueue()
        self._jobs: set[_LookupJob] = set()
        self._jobs_lock = threading.Lock()
        self._latency_s: dict[str, float] = {}  # target -> moving average of its lookups' latency
        self._stop = threading.Event()
        self._settler = threading.Thread(target=self._settle_loop, name="settle", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_loop, name="lookup-watchdog", daemon=True)
        self._settler.start()
        self._watchdog.start()

    # -- lookups ----------------------------------------------------------------------------
    def start(
        self, claims: Sequence[Claim], admissions: Admissions, rng: random.Random, settled: Sequence[Asked] = ()
    ) -> Future[dict[str, LookupVerdict]]:
        """Look each claim up (already reserved); ``settled``: claims answered without a lookup
        (breaker open, no lookup declared). The future holds the verdicts once all are settled."""
        call_events.lookups_claimed([*claims, *(a.claim for a in settled)])
        batch = _DoorbellLookups(admissions, rng, waiting=len(claims) + len(settled))
        if not batch.waiting:
            batch.done.set_result({})
            return batch.done
        if settled:
            self._answers.put((batch, list(settled)))
        groups: dict[str, deque[Claim]] = {}
        for claim in claims:
            groups.setdefault(self._downstream.actions.action(claim.action).target, deque()).append(claim)
        for target, todo in groups.items():
            if self._latency_s.get(target, 0.0) > SPREAD_AFTER_S:
                for claim in todo:
                    self._submit(_LookupJob(batch, target, deque([claim])))
            else:
                self._submit(_LookupJob(batch, target, todo))
        return batch.done

    def _submit(self, job: _LookupJob) -> None:
        with self._jobs_lock:
            self._jobs.add(job)
        self._pool.submit(self._run, job)

    def _run(self, job: _LookupJob) -> None:
        try:
            while True:
                with job.lock:
                    if not job.todo:
                        break
                    claim = job.todo.popleft()
                    job.running_since = started = time.monotonic()
                answer = ask(self._downstream, job.batch.admissions, claim)
                self._learn(job.target, answer, time.monotonic() - started)
                with job.lock:
                    job.running_since = None
                    job.finished.append(answer)
        finally:
            with self._jobs_lock:
                self._jobs.discard(job)
            with job.lock:
                finished, job.finished = job.finished, []
            if finished:
                self._answers.put((job.batch, finished))

    def _learn(self, target: str, answer: Asked, took_s: float) -> None:
        if answer.found is None:
            return  # not asked (breaker open) or cut part-way: says nothing of the target's pace
        seen = answer.found.latency_s if answer.found.latency_s is not None else took_s
        before = self._latency_s.get(target)
        self._latency_s[target] = seen if before is None else before + LATENCY_WEIGHT * (seen - before)

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            now = time.monotonic()
            with self._jobs_lock:
                jobs = list(self._jobs)
            for job in jobs:
                with job.lock:
                    slow = job.running_since is not None and now - job.running_since > HANDOFF_S
                    if not slow or not job.todo:
                        continue
                    todo, job.todo = list(job.todo), deque()
                    finished, job.finished = job.finished, []
                # What the slow lookup held up: settled now, and the rest looked up beside it.
                if finished:
                    self._answers.put((job.batch, finished))
                for claim in todo:
                    self._submit(_LookupJob(job.batch, job.target, deque([claim])))

    # -- settle -----------------------------------------------------------------------------
    def _settle_loop(self) -> None:
        while True:
            item = self._answers.get()
            if item is None:
                return
            items = [item]
            while True:  # whatever else has arrived goes into the same transaction
                try:
                    more = self._answers.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._answers.put(None)
                    break
                items.append(more)
            try:
                self._settle(items)
            except Exception:  # noqa: BLE001 - a bug: logged; the thread must outlive it
                log.exception("settler: unexpected error; the operations concerned come back through their leases")

    def _settle(self, arrived: list[tuple[_DoorbellLookups, list[Asked]]]) -> None:
        items = [(batch, asked) for batch, answers in arrived for asked in answers]
        verdicts: dict[str, LookupVerdict] = {}
        ids = [a.claim.operation_id for _, a in items]
        try:
            # A handoff's re-checks are judged and settled by their own rules (rechecks.py).
            cases = [(b.rng, a) for b, a in items if a.claim.status is Status.RECONCILIATION_REQUIRED]
            answers = [(b.rng, a) for b, a in items if a.claim.status is not Status.RECONCILIATION_REQUIRED]
            verdicts = settle_answers(self.recorder, answers, self._budget) if answers else {}
            if cases:
                verdicts |= settle_rechecks(self.recorder, cases, self._budget)
        except OUTAGES as exc:
            # Not retried here: the transaction may have committed before the broker refused a
            # re-dispatch doorbell, and a second settlement would take our own lookups for stale.
            log.warning(
                "settling lookups interrupted by an outage (%s); the operations are looked up again once their "
                "leases expire",
                type(exc).__name__,
                extra={"operation_ids": ids},
            )
        except Exception:  # noqa: BLE001 - a bug: logged; the leases bring these operations back
            log.exception(
                "settling lookups failed: the operations are looked up again once their leases expire",
                extra={"operation_ids": ids},
            )
        finally:
            self.room.give_back(len(items))  # first: nothing below may keep the room taken
            for batch, asked in items:
                if (verdict := verdicts.get(asked.claim.operation_id)) is not None:
                    batch.verdicts[asked.claim.operation_id] = verdict
                batch.waiting -= 1
                if batch.waiting == 0:
                    batch.admissions.tell_successes()
                    batch.done.set_result(batch.verdicts)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Let the lookups out finish and be settled (up to ``timeout_s``), then stop."""
        self.room.close()  # first: no new claims while the ones out drain
        if held := self.room.wait_empty(timeout_s):
            log.warning("%d lookup(s) still in flight at shutdown: their leases bring them back", held)
        self._stop.set()
        self._answers.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._settler.join(timeout=5)
        self._watchdog.join(timeout=1)
