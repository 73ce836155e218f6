"""Dispatch: one doorbell's story. Gate, claim, fan out, finalize.

1. gate (gate.py): which rung ids are due; those whose breaker is open are parked, not claimed;
2. claim (outbox/ledger/claims.py): the rest, under leases and fresh fencing tokens, topped up with
   whatever else is due;
3. fan out (in_flight.py, fan_out.py): one attempt each, off the task's thread, so a slow call
   holds only itself and the process takes its next doorbell meanwhile;
4. finalize (finalize.py): each outcome becomes exactly one guarded move; whatever has arrived
   commits in one transaction.

The retry loop is outside (the ledger's next_attempt_at + the relay); the breaker wraps exactly
one HTTP attempt. A read timeout may come after the provider committed: never resend, park in
outcome_unknown and let the reconciler ask the provider by key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from breaker import Admissions
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim, claim_due
from outbox.ledger.fairness import Fairness
from outbox.ledger.hot_path import LedgerConnection
from workers.dispatch.gate import Gate, SendChecks
from workers.dispatch.in_flight import InFlight
from workers.engine.outcomes import AttemptOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dispatcher:
    """What a dispatch doorbell takes: the gate, the process's calls in flight, and the claim's
    terms (OUTBOX_LEASE_S, OUTBOX_DOORBELL_BATCH, how long a doorbell waits for room, how the
    claim shares what is due among tenants: OUTBOX_FAIRNESS, OUTBOX_TENANT_WEIGHTS)."""

    gate: Gate
    in_flight: InFlight
    lease_s: float
    batch: int
    room_wait_s: float
    fairness: Fairness = field(default_factory=Fairness)

    def dispatch_one(self, operation_id: str) -> AttemptOutcome | None:
        """Handle one doorbell for one operation and wait for its outcome (see dispatch)."""
        return self.dispatch([operation_id]).get(operation_id)

    def dispatch(self, operation_ids: Sequence[str], *, wait: bool = True) -> dict[str, AttemptOutcome]:
        """Handle one doorbell carrying one or more operation ids. Returns the outcomes applied.

        Room first: a process with OUTBOX_MAX_IN_FLIGHT operations out waits (the broker keeps the
        doorbells, the ledger keeps the work) until one more fits, and claims as many as fit then.
        The breaker is asked before the claim: while it is open an operation is not claimed at all
        (no fencing token, no attempt number) and stays not_dispatched until the reopen time. The
        rest are claimed, with whatever else is due up to OUTBOX_DOORBELL_BATCH, and handed to the
        process's calls in flight (in_flight.py). A doorbell whose ids are all taken (a duplicate,
        or another doorbell's claim took them along) still claims whatever else is due: the ledger
        is the queue, a doorbell only says "work may be waiting".

        ``wait``: return after the calls are finalized (with their outcomes); the Celery task does
        not wait (only the gate's outcomes are returned).
        """
        room = self.in_flight.room
        size = room.take(self.batch, timeout_s=self.room_wait_s)
        if not size:
            log.info("no room: %d operation(s) in flight; doorbell left to the relay", room.held)
            return {}
        try:
            outcomes, claims, admissions, checks = self._gate_and_claim(operation_ids, size)
        except BaseException:
            room.give_back(size)
            raise
        room.give_back(size - len(claims))
        done = self.in_flight.start(claims, admissions, checks)
        if wait:
            outcomes.update(done.result())
        return outcomes

    def _gate_and_claim(
        self, operation_ids: Sequence[str], size: int
    ) -> tuple[dict[str, AttemptOutcome], list[Claim], Admissions, SendChecks]:
        gate = self.gate
        admissions = gate.admissions()
        try:
            passed = gate.admit(operation_ids, admissions)
            claims: list[Claim] = []
            if passed.wanted or not passed.rung_due:
                # While some rung ids wait for their breaker (parked just below), the claim takes the
                # wanted ids alone: filled with whatever else is due, it could take those along too.
                fill = not passed.to_park
                claims = _claim(
                    gate.ledger,
                    gate.worker_id,
                    self.lease_s,
                    passed.wanted,
                    size,
                    self.fairness,
                    fill,
                    versions=gate.actions.versions,
                )
            if not claims:
                log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
            gate.admit_taken_along(claims, admissions)
            admissions.give_back_all(keep=[c.operation_id for c in claims])  # probes we will not send
            parked = gate.park(passed)
            checks = gate.checks(claims)
            for claim in claims:
                failpoints.hit("dispatch.after_claim", claim.idempotency_key)
        except BaseException:
            admissions.give_back_all()
            raise
        # Most budget left first here too: after a failed canary each call asks the breaker in turn.
        claims.sort(key=lambda c: c.attempt_count)
        return parked, claims, admissions, checks


def _claim(
    ledger: LedgerConnection,
    worker_id: str,
    lease_s: float,
    wanted: list[str],
    size: int,
    fairness: Fairness,
    fill: bool = True,
    versions: Mapping[str, str] | None = None,
) -> list[Claim]:
    """A doorbell wakes a worker; the database says what is due. The same statement fills the batch
    with whatever else is due now, shared among tenants (outbox/ledger/fairness.py): the rung ids
    come first within their own tenant only, so one tenant's doorbells cannot keep another's due
    work out; those ids' own doorbells will in turn claim whatever is due then. No rung id due:
    whatever is due, up to ``size``. ``fill`` False (with ids): only those ids. Room for fewer
    than the rung ids (a busy process): the first ``size`` of them (the rest stay due). Each attempt
    row records ``versions``' version of its action, this worker's (outbox/ledger/request_record.py)."""
    wanted = wanted[:size]
    if fill and fairness.on and len(wanted) >= size > 1:
        # Room for one row the ids did not name, so another tenant's due row can still win its turn;
        # the id left out is still due and competes as any other row (in its tenant's order). Room
        # for one only (a busy process): the rung id, which may hold its breaker's probe.
        wanted = wanted[: size - 1]
    with ledger.one_statement() as session:
        return claim_due(
            session,
            worker=worker_id,
            lease_s=lease_s,
            operation_ids=wanted or None,
            limit=len(wanted) if wanted else size,
            also_due=size - len(wanted) if wanted and fill else 0,
            fairness=fairness,
            versions=versions,
        )
