"""Lookups in flight: a reconciler process's claimed lookups, run on the engine's in-flight pool
(workers/engine/in_flight.py: lanes per target, the watchdog, one committer, room), so the
process's capacity is its room, not one provider round trip at a time.

What is the reconciler's own here:

- the pace of each target (``LookupPace``): a doorbell's lookups of one target share one lane
  while that target answers lookups within SPREAD_AFTER_S (a provider that answers in
  milliseconds needs nothing more); a target whose last lookups took longer gets a thread per
  lookup, all of a doorbell's at once;
- the commit: the committer judges whatever has arrived (one read of the dispatch attempts for all
  "not found" answers) and settles it in one transaction (verdicts.settle_answers; a handoff's
  re-checks by their own rules, rechecks.py). An outage there is not retried: the transaction may
  have committed before the broker refused a re-dispatch doorbell, and a second settlement would
  take our own lookups for stale.

A crash loses nothing: every claimed operation holds the lookup's lease, and is claimed again once
it expires (its open lookup row stays as the record of a question never answered).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future

from breaker import Admissions
from outbox.ledger.claims import Claim
from outbox.ledger.states import Status
from workers.engine import call_events
from workers.engine.committer import Committer
from workers.engine.downstream import Downstream
from workers.engine.in_flight import Batch, InFlightPool, Lane
from workers.ground import metrics
from workers.ground.outage import OUTAGES
from workers.reconcile.judge import LookupVerdict
from workers.reconcile.lookup import Asked, LookupBudget, ask
from workers.reconcile.rechecks import settle_rechecks
from workers.reconcile.verdicts import settle_answers

log = logging.getLogger(__name__)

# A target whose lookups take longer than this (a moving average, per process) gets a thread per
# lookup: waiting is then most of a lookup, and the hand-off to a thread (a fraction of a
# millisecond of CPU) is small beside it. A nearby provider answers in a few milliseconds, a
# provider's search endpoint in tens.
SPREAD_AFTER_S = 0.01
LATENCY_WEIGHT = 0.3  # of the newest lookup in the moving average

_Lane = Lane[Asked, LookupVerdict]


class LookupPace:
    """How fast each target answers lookups, as this process saw it (a moving average)."""

    def __init__(self) -> None:
        self._latency_s: dict[str, float] = {}

    def slow(self, target: str) -> bool:
        return self._latency_s.get(target, 0.0) > SPREAD_AFTER_S

    def learn(self, target: str, answer: Asked, took_s: float) -> None:
        if answer.found is None:
            return  # not asked (breaker open) or cut part-way: says nothing of the target's pace
        seen = answer.found.latency_s if answer.found.latency_s is not None else took_s
        before = self._latency_s.get(target)
        self._latency_s[target] = seen if before is None else before + LATENCY_WEIGHT * (seen - before)


class _Lookups:
    """The pool's work: a claim is one lookup; answers are judged and settled in one transaction."""

    def __init__(self, downstream: Downstream, committer: Committer, budget: LookupBudget) -> None:
        self._downstream = downstream
        self._rec = committer
        self._budget = budget
        self.pace = LookupPace()

    def target_of(self, claim: Claim) -> str | None:
        return self._downstream.actions.action(claim.action).target

    def spread(self, target: str | None) -> bool:
        return target is not None and self.pace.slow(target)

    def may_hand_off(self, target: str | None) -> bool:
        return True

    def claim_of(self, result: Asked) -> Claim:
        return result.claim

    def unwritten(self, result: Asked) -> None:
        return None

    def run(self, lane: _Lane, claim: Claim) -> Asked:
        started = time.monotonic()
        answer = ask(self._downstream, lane.batch.admissions, claim)
        if lane.target is not None:
            self.pace.learn(lane.target, answer, time.monotonic() - started)
        return answer

    def commit(self, arrived: list[tuple[Batch[Asked, LookupVerdict], Asked]]) -> dict[str, LookupVerdict]:
        ids = [a.claim.operation_id for _, a in arrived]
        try:
            # A handoff's re-checks are judged and settled by their own rules (rechecks.py).
            rr = Status.RECONCILIATION_REQUIRED
            cases = [(b.context, a) for b, a in arrived if a.claim.status is rr]
            answers = [(b.context, a) for b, a in arrived if a.claim.status is not rr]
            verdicts = settle_answers(self._rec, answers, self._budget) if answers else {}
            if cases:
                verdicts |= settle_rechecks(self._rec, cases, self._budget)
            return verdicts
        except OUTAGES as exc:
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
        return {}


class LookupsInFlight:
    def __init__(
        self,
        downstream: Downstream,
        committer: Committer,
        budget: LookupBudget,
        *,
        max_ops: int,
        ledger: str | None = None,
    ) -> None:
        """``ledger``: the fleet's ledger these lookups belong to (OUTBOX_DATABASE_URLS), for the gauge."""
        self.committer = committer
        self.max_ops = max_ops
        self._pool = InFlightPool(
            _Lookups(downstream, committer, budget),
            max_ops=max_ops,
            name="lookup",
            record=lambda held: metrics.record_lookups_in_flight(held, ledger),
        )
        self.room = self._pool.room

    def start(
        self, claims: Sequence[Claim], admissions: Admissions, rng: random.Random, settled: Sequence[Asked] = ()
    ) -> Future[dict[str, LookupVerdict]]:
        """Look each claim up (already reserved); ``settled``: claims answered without a lookup
        (breaker open, no lookup declared). The future holds the verdicts once all are settled."""
        call_events.lookups_claimed([*claims, *(a.claim for a in settled)])
        return self._pool.start(claims, admissions, rng, ready=settled)

    def close(self, timeout_s: float) -> None:
        """Let the lookups out finish and be settled (up to ``timeout_s``), then stop."""
        self._pool.close(timeout_s)
