"""Lookups in flight: a reconciler process's claimed lookups, run off the doorbell task's thread, so
the process's capacity is its room, not one provider round trip at a time.

A reconcile doorbell task claims (reconcile.py), hands its claims here and returns: the process
takes its next doorbell while the lookups are out. Here:

- each lookup runs on a pool thread of its own (a lookup is a read: nothing to order, and every
  one waits on the provider);
- answers go to one settler thread, which judges whatever has arrived (one read of the dispatch
  attempts for all "not found" answers) and settles it in one transaction (settle.settle_all);
- room: at most ``max_ops`` operations claimed and not yet settled per process
  (OUTBOX_MAX_IN_FLIGHT). A doorbell task waits for room before it claims (backpressure: the
  broker holds the doorbells, the ledger holds the work).

A crash loses nothing: every claimed operation holds the lookup's lease, and is claimed again once
it expires (its open lookup row stays as the record of a question never answered).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from breaker import Allowed, Open, counts_as_failure
from downstream.actions import ActionConfig
from downstream.lookups import LookupResult
from outbox import failpoints
from outbox.claims import Claim
from outbox.envelope import loads_exact
from outbox.models import Attempt
from outbox.states import AttemptClass, AttemptKind, Status
from workers import metrics
from workers.fan_out import Caller
from workers.finalize import Recorder
from workers.judge import DispatchAttempt, Settlement, after_not_found, dispatch_window, judge, recheck
from workers.outage import OUTAGES
from workers.settle import Looked, settle_all

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupBudget:
    """The reconciler's own budget: lookups before a person decides, and the cap of the backoff
    between them (OUTBOX_RECONCILE_MAX_LOOKUPS, OUTBOX_RECONCILE_MAX_DELAY_S)."""

    max_lookups: int
    max_delay_s: float


@dataclass
class SharedBreakers:
    """A doorbell's breaker answers: a closed breaker admits every lookup, so it is asked once per
    target per doorbell and told one success at the end (each failure is told at once, and then
    the next lookup asks again)."""

    closed: dict[str, Allowed]  # target -> the closed breaker's admission, shared by the batch
    succeeded: dict[str, Allowed]  # target -> a success not yet told


@dataclass(frozen=True)
class Asked:
    """One claimed operation, and what the provider answered (``found``), or why it was not asked
    and what follows (``early``)."""

    claim: Claim
    action: ActionConfig | None
    found: LookupResult | None = None
    early: Settlement | None = None


@dataclass
class Doorbatch:
    """One doorbell's claims on their way: done when every one is settled."""

    shared: SharedBreakers
    rng: random.Random
    waiting: int
    settlements: dict[str, Settlement] = field(default_factory=dict)
    done: Future[dict[str, Settlement]] = field(default_factory=Future)


class LookupsInFlight:
    def __init__(self, caller: Caller, recorder: Recorder, budget: LookupBudget, *, max_ops: int) -> None:
        self._caller = caller
        self._rec = recorder
        self._budget = budget
        self.max_ops = max_ops
        self._pool = ThreadPoolExecutor(max_workers=max_ops, thread_name_prefix="lookup")
        self._room = threading.Condition()
        self._held = 0  # operations reserved or claimed here, not yet settled
        self._answers: queue.SimpleQueue[tuple[Doorbatch, Asked] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._settler = threading.Thread(target=self._settle_loop, name="settle", daemon=True)
        self._settler.start()

    # -- room -------------------------------------------------------------------------------
    def reserve(self, n: int, *, timeout_s: float) -> bool:
        """Wait until ``n`` more operations fit (all of them, or an empty process); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._room:
            while self._held and self._held + n > self.max_ops:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._room.wait(left)
            self._held += n
            metrics.record_lookups_in_flight(self._held)
            return True

    def release(self, n: int) -> None:
        if n:
            with self._room:
                self._held -= n
                self._room.notify_all()
            metrics.record_lookups_in_flight(self._held)

    @property
    def held(self) -> int:
        return self._held

    # -- lookups ----------------------------------------------------------------------------
    def start(
        self, claims: Sequence[Claim], shared: SharedBreakers, rng: random.Random, settled: Sequence[Asked] = ()
    ) -> Future[dict[str, Settlement]]:
        """Look each claim up (already reserved); ``settled``: claims answered without a lookup
        (breaker open, no lookup declared). The future holds the settlements once all are settled."""
        batch = Doorbatch(shared, rng, waiting=len(claims) + len(settled))
        if not batch.waiting:
            batch.done.set_result({})
            return batch.done
        for asked in settled:
            self._answers.put((batch, asked))
        for claim in claims:
            self._pool.submit(self._look_up, batch, claim)
        return batch.done

    def _look_up(self, batch: Doorbatch, claim: Claim) -> None:
        self._answers.put((batch, ask(self._caller, claim, batch.shared, batch.rng, self._budget)))

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

    def _settle(self, items: list[tuple[Doorbatch, Asked]]) -> None:
        settlements: dict[str, Settlement] = {}
        ids = [a.claim.operation_id for _, a in items]
        try:
            settlements = settle_answers(self._rec, [(b.rng, a) for b, a in items], self._budget)
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
            self.release(len(items))  # first: nothing below may keep the room taken
            for batch, asked in items:
                if (verdict := settlements.get(asked.claim.operation_id)) is not None:
                    batch.settlements[asked.claim.operation_id] = verdict
                batch.waiting -= 1
                if batch.waiting == 0:
                    # One success per target per doorbell: each failure was recorded as it happened.
                    for decision in batch.shared.succeeded.values():
                        self._caller.breakers.record(decision, failure=False)
                    batch.done.set_result(batch.settlements)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Let the lookups out finish and be settled (up to ``timeout_s``), then stop."""
        deadline = time.monotonic() + timeout_s
        with self._room:
            while self._held and time.monotonic() < deadline:
                self._room.wait(max(0.0, deadline - time.monotonic()))
        if self._held:
            log.warning("%d lookup(s) still in flight at shutdown: their leases bring them back", self._held)
        self._stop.set()
        self._answers.put(None)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._settler.join(timeout=5)


def breaker_open(action: ActionConfig, decision: Open) -> Settlement:
    """Not asked: the target's breaker is open; look again when it may close."""
    return Settlement(
        Status.OUTCOME_UNKNOWN,
        AttemptClass.AMBIGUOUS,
        f"breaker for {action.target} open: lookup later",
        recheck_in_s=decision.wait_s,
    )


def ask(caller: Caller, claim: Claim, shared: SharedBreakers, rng: random.Random, budget: LookupBudget) -> Asked:
    """One lookup, on a lookup thread: the breaker, the provider's answer, the breaker told. Nothing
    here writes to the ledger (settle_answers judges and settles)."""
    action = caller.actions.action(claim.action)
    try:
        decision = shared.closed.get(action.target) or caller.breakers.before_call(action.target)
        if isinstance(decision, Open):
            return Asked(claim, action, early=breaker_open(action, decision))
        found = caller.connectors.for_action(claim.action).lookup(
            claim.action,
            action,
            args=loads_exact(claim.args or "{}"),
            idempotency_key=claim.provider_key,
            tenant=claim.tenant,
            fencing_token=claim.fencing_token,
        )
        failpoints.hit("reconcile.after_lookup", claim.idempotency_key)
        unavailable = found.outcome == "unavailable"
        failure = unavailable and counts_as_failure(found.status_code, transport_error=found.status_code is None)
        if not failure and not decision.probe:
            shared.succeeded[action.target] = decision
        else:
            shared.closed.pop(action.target, None)  # the next lookup asks the breaker again
            caller.breakers.record(decision, failure=failure)
        return Asked(claim, action, found)
    except Exception as exc:  # noqa: BLE001 - a lookup cut part-way proves nothing: look again later
        log.warning(
            "lookup cut part-way (%s: %s): looked up again later",
            type(exc).__name__,
            str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
            extra={"operation_id": claim.operation_id, "idempotency_key": claim.idempotency_key},
        )
        why = f"the lookup was cut part-way ({type(exc).__name__})"
        return Asked(
            claim,
            action,
            early=recheck(claim, why, rng, max_lookups=budget.max_lookups, max_delay_s=budget.max_delay_s),
        )


def settle_answers(
    rec: Recorder, items: Sequence[tuple[random.Random, Asked]], budget: LookupBudget
) -> dict[str, Settlement]:
    """Judge what the provider answered (one read of the dispatch attempts for every "not found")
    and settle it all in one transaction (settle.settle_all)."""
    not_found = [a.claim.operation_id for _, a in items if a.found is not None and a.found.outcome == "not_found"]
    attempts: dict[str, list[DispatchAttempt]] = {}
    if not_found:
        with rec.sessions() as session:
            attempts = _dispatch_attempts(session, not_found)
    looked = [_judged(rec, a, rng, attempts.get(a.claim.operation_id, []), budget) for rng, a in items]
    return settle_all(rec, looked)


def _judged(
    rec: Recorder, asked: Asked, rng: random.Random, attempts: list[DispatchAttempt], budget: LookupBudget
) -> Looked:
    claim, action, found = asked.claim, asked.action, asked.found
    if asked.early is not None or found is None or action is None:
        assert asked.early is not None
        return Looked(claim, None, asked.early, action)
    first_sent = last_activity = None
    if found.outcome == "not_found":  # only "not found" is judged against the dispatch attempts
        target = rec.actions.target_of(action)
        first_sent, last_activity = dispatch_window(
            attempts, call_timeout_s=target.timeout_s + target.connect_timeout_s, after=claim.proven_absent_through
        )
    max_lookups, max_delay_s = budget.max_lookups, budget.max_delay_s
    verdict = judge(
        claim,
        action,
        found,
        now=claim.now(),
        last_activity=last_activity,
        first_sent=first_sent,
        rng=rng,
        max_lookups=max_lookups,
        max_delay_s=max_delay_s,
    )
    if verdict.to is Status.NOT_DISPATCHED:  # only after "not found": the attempts were read above
        verdict = after_not_found(
            claim, action, verdict, attempts, now=claim.now(), rng=rng, max_lookups=max_lookups, max_delay_s=max_delay_s
        )
    return Looked(claim, found, verdict, action)


def _dispatch_attempts(session: Session, operation_ids: Sequence[str]) -> dict[str, list[DispatchAttempt]]:
    """One read of these operations' dispatch attempts, each in order: both judgements of a "not
    found" (dispatch_window, after_not_found)."""
    rows = session.execute(
        select(
            Attempt.operation_id,
            Attempt.attempt_number,
            Attempt.fencing_token,
            Attempt.attempt_class,
            Attempt.error,
            Attempt.started_at,
            Attempt.ended_at,
        )
        .where(Attempt.operation_id.in_(list(operation_ids)), Attempt.kind == AttemptKind.DISPATCH.value)
        .order_by(Attempt.operation_id, Attempt.attempt_number)
    ).all()
    out: dict[str, list[DispatchAttempt]] = {}
    for r in rows:
        out.setdefault(r.operation_id, []).append(
            DispatchAttempt(
                r.attempt_number, r.fencing_token, AttemptClass(r.attempt_class), r.error, r.started_at, r.ended_at
            )
        )
    return out
