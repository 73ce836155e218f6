"""Calls in flight: a worker process's claimed calls, run on the engine's in-flight pool
(workers/engine/in_flight.py: lanes per target, the watchdog, one committer, room), so a slow call
holds only itself.

What is dispatch's own here:

- the call: a suspect target gets one call at a time from the whole process (canary.py);
- a call that breaks part-way is in doubt (it may have been sent): it goes to the reconciler at
  once as outcome_unknown, not minutes later through lease expiry;
- the commit: the committer finalizes whatever has arrived in one transaction (finalize.py's
  ``finalize_attempts``) on its own connection; a ledger outage there is retried while the leases last (a
  PostgreSQL restart then costs no reconciliation). Calls beyond a target's max_connections wait
  for a connection of its pool (per-target concurrency stays as configured).

A crash loses nothing: every claimed operation holds a lease, which expires into outcome_unknown,
and the reconciler asks the provider (as for a crash inside a task).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from breaker import Admissions
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass
from outbox.ledger.transitions import AttemptReport
from workers.dispatch.canary import Canaries
from workers.dispatch.fan_out import Attempted, attempt_claimed
from workers.dispatch.finalize import finalize_attempts
from workers.dispatch.gate import SendChecks
from workers.engine import call_events
from workers.engine.committer import Committer
from workers.engine.downstream import Downstream
from workers.engine.in_flight import Batch, InFlightPool, Lane
from workers.engine.outcomes import Ambiguous, AttemptOutcome
from workers.ground import metrics
from workers.ground.outage import OUTAGES

log = logging.getLogger(__name__)

# A finalize that meets a ledger outage is retried this long (bounded by the lease: after it the
# sweep owns the operation and our write would be refused anyway).
FINALIZE_RETRY_S = 20.0

_Lane = Lane[Attempted, AttemptOutcome]


class _Calls:
    """The pool's work: a claim is one call; results are finalized in one transaction."""

    def __init__(self, downstream: Downstream, committer: Committer, retry_s: float) -> None:
        self._downstream = downstream
        self._rec = committer
        self._retry_s = retry_s
        self.canaries = Canaries(downstream.actions)
        self.stopping: Callable[[], bool] = lambda: False

    def target_of(self, claim: Claim) -> str | None:
        known = self._downstream.actions.actions.get(claim.action)
        return known.target if known else None

    def spread(self, target: str | None) -> bool:
        return False

    def may_hand_off(self, target: str | None) -> bool:
        return not self.canaries.suspect(target)  # one at a time until it answers well: nothing to give away

    def claim_of(self, result: Attempted) -> Claim:
        return result[0]

    def unwritten(self, result: Attempted) -> AttemptOutcome:
        return result[2]

    def run(self, lane: _Lane, claim: Claim) -> Attempted:
        """The call; if it breaks part-way (the breaker's Redis away, a bug), the operation is in
        doubt: it may have been sent, so it goes to the reconciler now, with its room freed, not
        minutes later through lease expiry."""
        try:
            return self._call(lane, claim)
        except Exception as exc:  # noqa: BLE001 - becomes outcome_unknown; logged with its operation
            lane.batch.admissions.give_back(claim.operation_id)  # a probe must not stay taken until its lock expires
            log.warning(
                "attempt cut part-way (%s: %s): parked in outcome_unknown for a lookup",
                type(exc).__name__,
                str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "",
                extra=claim.log_fields(),
            )
            why = f"the attempt was cut part-way ({type(exc).__name__}); it may have been sent: looking it up"
            return claim, AttemptReport(AttemptClass.AMBIGUOUS, error=why), Ambiguous(why), None

    def _call(self, lane: _Lane, claim: Claim) -> Attempted:
        admissions, target, canaries = lane.batch.admissions, lane.target, self.canaries
        checks: SendChecks = lane.batch.context
        call = (self._downstream, admissions, claim, checks)
        if target is None:  # not in the actions file: nothing is sent
            return attempt_claimed(*call)
        if not canaries.suspect(target):
            result = attempt_claimed(*call)
        else:
            with canaries.lock(target):  # one call at a time to a suspect target
                if not canaries.suspect(target):  # the call before this one answered well
                    result = attempt_claimed(*call)
                else:
                    admissions.give_back(claim.operation_id)
                    admissions.unshare(target)
                    result = attempt_claimed(*call)  # asks the breaker now
                    # Answered (not a failure) under a closed breaker: the batch's other calls go
                    # on with that admission instead of each asking Redis again.
                    admissions.share_success(target)
        canaries.learn(target, result[1])
        canaries.tell_success_soon(admissions, target)
        return result

    def commit(self, arrived: list[tuple[Batch[Attempted, AttemptOutcome], Attempted]]) -> dict[str, AttemptOutcome]:
        attempted = [a for _, a in arrived]
        for claim, _, _, _ in attempted:
            failpoints.hit("dispatch.after_response", claim.idempotency_key)
        try:
            return self._finalize(attempted)
        except Exception:  # noqa: BLE001 - logged; the leases bring these operations back
            log.exception(
                "finalize failed: claimed operations come back through lease expiry and the reconciler",
                extra={"operation_ids": [c.operation_id for c, _, _, _ in attempted]},
            )
            return {}

    def _finalize(self, attempted: list[Attempted]) -> dict[str, AttemptOutcome]:
        give_up = time.monotonic() + self._retry_s
        delay = 0.2
        while True:
            try:
                return finalize_attempts(self._rec, attempted)
            except OUTAGES as exc:
                if time.monotonic() + delay > give_up or self.stopping():
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


class InFlight:
    def __init__(
        self, downstream: Downstream, committer: Committer, *, max_ops: int, lease_s: float, ledger: str | None = None
    ) -> None:
        """``ledger``: the fleet's ledger these calls belong to (OUTBOX_DATABASE_URLS), for the gauge."""
        self._rec = committer
        self._calls = _Calls(downstream, committer, min(FINALIZE_RETRY_S, lease_s / 2))
        self._pool = InFlightPool(
            self._calls, max_ops=max_ops, name="call", record=lambda held: metrics.record_in_flight(held, ledger)
        )
        self._calls.stopping = lambda: self._pool.stopping
        self.max_ops = max_ops
        self.room = self._pool.room

    def start(
        self, claims: Sequence[Claim], admissions: Admissions, checks: SendChecks
    ) -> Future[dict[str, AttemptOutcome]]:
        """Call each claim (already reserved); the future holds the outcomes once all are finalized."""
        call_events.claimed(claims)
        return self._pool.start(claims, admissions, checks)

    def close(self, timeout_s: float) -> None:
        """Let the calls out finish and be finalized (up to ``timeout_s``), then stop."""
        self._pool.close(timeout_s)
        self._rec.ledger.close()
