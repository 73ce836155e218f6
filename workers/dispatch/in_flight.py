"""In flight: a worker process's claimed calls, run off the doorbell task's thread, so a slow call
holds only itself.

A doorbell task gates and claims (batch.py), hands its claims here and returns: the process
takes its next doorbell while the calls are out. Here:

- a batch's calls to one target run on one pool thread, one after another: a fast target needs
  nothing more (handing each call to a thread of its own costs more CPU than such a call waits);
- a call still running after HANDOFF_S gives away its batch's calls not yet started, one pool
  thread each (the watchdog), so one 1.5 s timeout holds one operation, not the nine behind it;
- a suspect target gets one call at a time from the whole process, each asking the breaker first
  (a canary): at start, and after a quarter of its breaker's fail_max failures in a row seen by
  this process, until a call answers well. So a process never piles its calls in flight onto a
  target that is going down (with fail_max 3 the breaker opens after 3 failures plus at most one
  call in flight per other process), while a target that fails some calls and answers others (a
  provider that faults a share of first requests) keeps its calls overlapping: serializing on
  every failure would put each read timeout back in front of the calls behind it;
- results go to one finalizer thread, which applies whatever has arrived in one transaction
  (finalize.apply_many) on its own connection; a ledger outage there is retried while the leases
  last (a PostgreSQL restart then costs no reconciliation);
- room: at most ``max_ops`` operations claimed and not yet finalized per process (room.py: a
  doorbell task waits for one place before it claims, and claims as many as fit). Calls beyond a
  target's max_connections wait for a connection of its pool (per-target concurrency stays as
  configured).

A crash loses nothing: every claimed operation holds a lease, which expires into outcome_unknown,
and the reconciler asks the provider (as for a crash inside a task).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from breaker import Admissions
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass
from outbox.ledger.transitions import AttemptReport
from workers.dispatch.fan_out import Attempted, Downstream, attempt_claimed
from workers.dispatch.finalize import Recorder, apply_many
from workers.dispatch.gate import SendChecks
from workers.dispatch.outcomes import Ambiguous, AttemptOutcome
from workers.dispatch.room import Room
from workers.relay.outage import OUTAGES
from workers.wiring import call_events, metrics

log = logging.getLogger(__name__)

# A call running longer than this gives away the calls queued behind it. Well above a healthy
# call to a nearby provider (a few milliseconds), well below any read timeout.
HANDOFF_S = 0.05
WATCH_EVERY_S = 0.02
# A target's successes are told to its breaker at most this often per process (see
# _tell_success_soon): each telling is a Redis round trip.
SUCCESS_EVERY_S = 0.05
# A finalize that meets a ledger outage is retried this long (bounded by the lease: after it the
# sweep owns the operation and our write would be refused anyway).
FINALIZE_RETRY_S = 20.0


@dataclass
class _DoorbellCalls:
    """One doorbell's claims on their way: done when every one is finalized."""

    admissions: Admissions
    # Claims whose action needs a person's approval: the approval on record (None: none), read with
    # the claim and judged again right before the send (outbox/approvals/decisions.py); and those whose
    # business object is held back by another operation (outbox/ledger/objects.py).
    checks: SendChecks
    waiting: int
    outcomes: dict[str, AttemptOutcome] = field(default_factory=dict)
    done: Future[dict[str, AttemptOutcome]] = field(default_factory=Future)


@dataclass(eq=False)  # a job is itself: held in a set while it runs
class _CallJob:
    """Calls to one target of one doorbell, run in turn on one pool thread."""

    batch: _DoorbellCalls
    target: str | None
    todo: deque[Claim]
    running_since: float | None = None
    finished: list[Attempted] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class InFlight:
    def __init__(
        self, downstream: Downstream, recorder: Recorder, *, max_ops: int, lease_s: float, ledger: str | None = None
    ) -> None:
        """``ledger``: the fleet's ledger these calls belong to (OUTBOX_DATABASE_URLS), for the gauge."""
        self._downstream = downstream
        self._rec = recorder
        self.max_ops = max_ops
        self._retry_s = min(FINALIZE_RETRY_S, lease_s / 2)
        self._pool = ThreadPoolExecutor(max_workers=max_ops, thread_name_prefix="call")
        # Reserved or claimed here, not yet finalized.
        self.room = Room(max_ops, lambda held: metrics.record_in_flight(held, ledger))
        self._jobs: set[_CallJob] = set()
        self._jobs_lock = threading.Lock()
        # Counted failures in a row per target, as seen by this process (absent: no answer yet).
        self._failures: dict[str, int] = {}
        self._failed_since: dict[str, bool] = {}  # a failure seen here since the last success told
        self._success_told: dict[str, float] = {}  # when a success was last told to the breaker
        self._canaries: dict[str, threading.Lock] = {}
        self._results: queue.SimpleQueue[tuple[_DoorbellCalls, list[Attempted]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._finalizer = threading.Thread(target=self._finalize_loop, name="finalize", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_loop, name="call-watchdog", daemon=True)
        self._finalizer.start()
        self._watchdog.start()

    # -- calls ------------------------------------------------------------------------------
    def start(
        self, claims: Sequence[Claim], admissions: Admissions, checks: SendChecks
    ) -> Future[dict[str, AttemptOutcome]]:
        """Call each claim (already reserved); the future holds the outcomes once all are finalized."""
        call_events.claimed(claims)
        batch = _DoorbellCalls(admissions, checks, waiting=len(claims))
        if not claims:
            batch.done.set_result({})
            return batch.done
        groups: dict[str | None, deque[Claim]] = {}
        for claim in claims:
            known = self._downstream.actions.actions.get(claim.action)
            groups.setdefault(known.target if known else None, deque()).append(claim)
        for target, todo in groups.items():
            self._submit(_CallJob(batch, target, todo))
        return batch.done

    def _submit(self, job: _CallJob) -> None:
        with self._jobs_lock:
            self._jobs.add(job)
        self._pool.submit(self._run, job)

    def _run(self, job: _CallJob) -> None:
        try:
            while True:
                with job.lock:
                    if not job.todo:
                        break
                    claim = job.todo.popleft()
                    job.running_since = time.monotonic()
                result = self._call_or_doubt(job, claim)
                with job.lock:
                    job.running_since = None
                    job.finished.append(result)
        finally:
            with self._jobs_lock:
                self._jobs.discard(job)
            with job.lock:
                finished, job.finished = job.finished, []
            if finished:
                self._results.put((job.batch, finished))

    def _call_or_doubt(self, job: _CallJob, claim: Claim) -> Attempted:
        """The call; if it breaks part-way (the breaker's Redis away, a bug), the operation is in
        doubt: it may have been sent, so it goes to the reconciler now, with its room freed, not
        minutes later through lease expiry."""
        try:
            return self._call(job, claim)
        except Exception as exc:  # noqa: BLE001 - becomes outcome_unknown; logged with its operation
            job.batch.admissions.give_back(claim.operation_id)  # a probe must not stay taken until its lock expires
            log.warning(
                "attempt cut part-way (%s: %s): parked in outcome_unknown for a lookup",
                type(exc).__name__,
                str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
                extra=claim.log_fields(),
            )
            why = f"the attempt was cut part-way ({type(exc).__name__}); it may have been sent: looking it up"
            return claim, AttemptReport(AttemptClass.AMBIGUOUS, error=why), Ambiguous(why), None

    def _call(self, job: _CallJob, claim: Claim) -> Attempted:
        admissions, target = job.batch.admissions, job.target
        call = (self._downstream, admissions, claim, job.batch.checks)
        if target is None:  # not in the actions file: nothing is sent
            return attempt_claimed(*call)
        if not self._suspect(target):
            result = attempt_claimed(*call)
        else:
            with self._canary_lock(target):  # one call at a time to a suspect target
                if not self._suspect(target):  # the call before this one answered well
                    result = attempt_claimed(*call)
                else:
                    admissions.give_back(claim.operation_id)
                    admissions.unshare(target)
                    result = attempt_claimed(*call)  # asks the breaker now
                    # Answered (not a failure) under a closed breaker: the batch's other calls go
                    # on with that admission instead of each asking Redis again.
                    admissions.share_success(target)
        self._learn(target, result[1])
        self._tell_success_soon(admissions, target)
        return result

    def _tell_success_soon(self, admissions: Admissions, target: str) -> None:
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

    def _suspect(self, target: str | None) -> bool:
        if target is None:
            return False
        seen = self._failures.get(target)
        if seen is None:
            return True
        known = self._downstream.actions.targets.get(target)
        return seen >= max(1, -(-known.breaker.fail_max // 4)) if known is not None else seen > 0

    def _learn(self, target: str, report: AttemptReport) -> None:
        if report.klass in (AttemptClass.SUCCEEDED, AttemptClass.REJECTED):
            self._failures[target] = 0
        elif report.klass is not AttemptClass.NOT_SENT or report.latency_s is not None:
            # Not sent without a call (breaker open, budget spent) says nothing about the target;
            # a refused connection does.
            self._failures[target] = self._failures.get(target, 0) + 1
            self._failed_since[target] = True

    def _canary_lock(self, target: str) -> threading.Lock:
        with self._jobs_lock:
            return self._canaries.setdefault(target, threading.Lock())

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            now = time.monotonic()
            with self._jobs_lock:
                jobs = list(self._jobs)
            for job in jobs:
                self._hand_off_if_slow(job, now)

    def _hand_off_if_slow(self, job: _CallJob, now: float) -> None:
        if self._suspect(job.target):
            return  # one at a time until the target answers well: nothing to give away
        with job.lock:
            slow = job.running_since is not None and now - job.running_since > HANDOFF_S
            if not slow or not job.todo:
                return
            todo, job.todo = list(job.todo), deque()
            finished, job.finished = job.finished, []
        # What the slow call held up: finalized now, and the rest called beside it.
        if finished:
            self._results.put((job.batch, finished))
        for claim in todo:
            self._submit(_CallJob(job.batch, job.target, deque([claim])))

    # -- finalize ---------------------------------------------------------------------------
    def _finalize_loop(self) -> None:
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
                self._finalize(items)
            except Exception:  # noqa: BLE001 - a bug: logged; the thread must outlive it
                log.exception("finalizer: unexpected error; the operations concerned come back through their leases")

    def _finalize(self, items: list[tuple[_DoorbellCalls, list[Attempted]]]) -> None:
        attempted = [a for _, results in items for a in results]
        for claim, _, _, _ in attempted:
            failpoints.hit("dispatch.after_response", claim.idempotency_key)
        outcomes: dict[str, AttemptOutcome] = {}
        try:
            outcomes = self._apply(attempted)
        except Exception:  # noqa: BLE001 - logged; the leases bring these operations back
            log.exception(
                "finalize failed: claimed operations come back through lease expiry and the reconciler",
                extra={"operation_ids": [c.operation_id for c, _, _, _ in attempted]},
            )
        finally:
            self.room.give_back(len(attempted))  # first: nothing below may keep the room taken
            for batch, results in items:
                for claim, _, outcome, _ in results:
                    batch.outcomes[claim.operation_id] = outcomes.get(claim.operation_id, outcome)
                batch.waiting -= len(results)
                if batch.waiting == 0:
                    batch.admissions.tell_successes()
                    batch.done.set_result(batch.outcomes)

    def _apply(self, attempted: list[Attempted]) -> dict[str, AttemptOutcome]:
        give_up = time.monotonic() + self._retry_s
        delay = 0.2
        while True:
            try:
                return apply_many(self._rec, attempted)
            except OUTAGES as exc:
                if time.monotonic() + delay > give_up or self._stop.is_set():
                    log.warning(
                        "finalize interrupted by an outage (%s); claimed operations come back through lease "
                        "expiry and the reconciler",
                        type(exc).__name__,
                        extra={"operation_ids": [c.operation_id for c, _, _, _ in attempted]},
                    )
                    return {}
                log.info("finalize waits for the ledger (%s); retrying in %.1fs", type(exc).__name__, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Let the calls out finish and be finalized (up to ``timeout_s``), then stop."""
        self.room.close()  # first: no new claims while the ones out drain
        if held := self.room.wait_empty(timeout_s):
            log.warning("%d operation(s) still in flight at shutdown: their leases bring them back", held)
        self._stop.set()
        self._results.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._finalizer.join(timeout=5)
        self._watchdog.join(timeout=1)
        self._rec.ledger.close()
