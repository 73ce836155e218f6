"""The reconciler: settle outcome_unknown by asking the provider, never by re-sending.

A reconcile doorbell: late successes first (evidence wins), then a claim of due lookups (the
doorbell's ids, topped up with whatever else is due), a success webhook event the ledger kept before
its operation could take it (stored_events.py: it answers instead of a lookup), the breaker asked once per target, and the
lookups handed to the process's lookup threads (in_flight.py), which judge each answer (judge.py)
and settle whatever has arrived in one transaction (verdicts.py).

Every lookup carries the reconciler's fencing token (newer than every dispatch attempt's): a
provider that fences (``provider_fencing``) refuses the older ones from then on. Evidence wins: a
success that a worker got after losing its lease settles the operation (apply_late_successes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from breaker import Admissions, BreakerRegistry, Open
from outbox.evidence.rechecks import claim_rechecks
from outbox.ledger.claims import Claim, claim_unknown
from outbox.ledger.states import AttemptClass, Status
from workers.engine.committer import Committer
from workers.provider.actions import ActionConfig, ActionsFile
from workers.reconcile.in_flight import LookupsInFlight
from workers.reconcile.judge import LookupVerdict
from workers.reconcile.lookup import Asked, breaker_open
from workers.reconcile.stored_events import answered_by_events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reconciler:
    """What a reconcile doorbell takes: the committer (late successes; its sessions claim), the
    breakers, the process's lookups in flight, and the claim's terms (OUTBOX_LEASE_S, how long a
    doorbell waits for room)."""

    committer: Committer
    breakers: BreakerRegistry
    lookups: LookupsInFlight
    lease_s: float
    room_wait_s: float

    def reconcile_one(self, operation_id: str, *, rng: random.Random | None = None) -> LookupVerdict | None:
        """One operation's reconcile doorbell (None: settled by a late success, or nothing to claim)."""
        return self.reconcile([operation_id], rng=rng).get(operation_id)

    def reconcile(
        self,
        operation_ids: Sequence[str],
        *,
        rng: random.Random | None = None,
        fill_to: int = 0,
        wait: bool = True,
    ) -> dict[str, LookupVerdict]:
        """A reconcile doorbell's ids: late successes first, then a claim, a lookup each on the
        process's lookup threads (in_flight.py: overlapped, so a process looks up as many
        operations at once as its room holds), and one transaction that settles whatever has
        arrived (each move still guarded by its own token). Returns the verdicts carried out (ids
        settled otherwise are absent); ``wait=False`` (the Celery task) returns at once, with nothing.

        ``fill_to``: the claim takes the doorbell's ids first, then other due outcome_unknown
        operations, oldest first, up to this many in all (the Celery task: OUTBOX_DOORBELL_BATCH). A
        doorbell only says "lookups may be waiting": whatever its ids became (settled, looked up by
        another doorbell's claim), it claims what is due, so a task finds nothing to do only when
        nothing is. Those taken along get no late-success check first: a lookup finds the effect,
        and the ledger's guard refuses "no effect" while a success is on record."""
        rng = rng or random.Random()
        rec = self.committer
        settled = rec.late_successes(operation_ids=list(operation_ids)) if operation_ids else {}
        wanted = [op_id for op_id in operation_ids if op_id not in settled]
        size = max(fill_to, len(wanted))
        if not size:
            return {}
        lookups = self.lookups
        room = lookups.room
        size = room.take(size, timeout_s=self.room_wait_s)
        if not size:
            log.info("no room: %d lookup(s) in flight; doorbell left to the relay", room.held)
            return {}
        wanted = wanted[:size]  # room for fewer than the rung ids: the rest stay due
        try:
            claims = _claim(rec.sessions, rec.worker_id, self.lease_s, wanted, size)
        except BaseException:
            room.give_back(size)
            raise
        room.give_back(size - len(claims))
        if not claims:
            log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
        # After a failed lookup the next one asks the breaker again (no canary rule here).
        admissions = Admissions(self.breakers, ask_again_after_failure=True)
        try:
            # A success event the ledger kept before the operation could take it answers first.
            answered = answered_by_events(rec, claims)
            by_event = {a.claim.operation_id for a in answered}
            answered += _ask_breakers_once(
                rec.actions, admissions, [c for c in claims if c.operation_id not in by_event]
            )
        except BaseException:
            room.give_back(len(claims))
            raise
        not_asked = {a.claim.operation_id for a in answered}
        looking = [c for c in claims if c.operation_id not in not_asked]
        done = lookups.start(looking, admissions, rng, answered)
        return done.result() if wait else {}


def _claim(
    sessions: sessionmaker[Session], worker_id: str, lease_s: float, wanted: list[str], size: int
) -> list[Claim]:
    """The given ids, then whatever else is due up to ``size``: topped up by a second statement
    when some of the ids were no longer claimable (settled, or taken along by another claim), then
    with handoffs whose re-check is due (outbox/evidence/rechecks.py: the slow lane, hours apart,
    which takes the room the outcome_unknown lookups leave)."""
    with sessions.begin() as session:
        if not wanted:
            claims = claim_unknown(session, worker=worker_id, lease_s=lease_s, limit=size)
        else:
            claims = claim_unknown(
                session,
                worker=worker_id,
                lease_s=lease_s,
                operation_ids=wanted,
                limit=len(wanted),
                also_due=size - len(wanted),
            )
            if len(claims) < size:
                claims += claim_unknown(session, worker=worker_id, lease_s=lease_s, limit=size - len(claims))
        if len(claims) < size:
            claims += claim_rechecks(session, worker=worker_id, lease_s=lease_s, limit=size - len(claims))
    return claims


def _ask_breakers_once(actions: ActionsFile, admissions: Admissions, claims: Sequence[Claim]) -> list[Asked]:
    """Before the lookups leave: the claims that will not be looked up (an action unknown or
    without a lookup: a person), and the breaker asked once per target. Open: that target's claims
    are looked up later, not now. A probe is given back: the first lookup to ask takes it."""
    answered: list[Asked] = []
    by_target: dict[str, list[tuple[Claim, ActionConfig]]] = {}
    for claim in claims:
        action = actions.actions.get(claim.action)
        if action is None:
            why = f"unknown action {claim.action!r}: cannot look it up"
        elif action.lookup is None:
            why = "no lookup declared for this action: a person must check the provider"
        else:
            by_target.setdefault(action.target, []).append((claim, action))
            continue
        answered.append(
            Asked(claim, action, early=LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, why))
        )
    decisions = admissions.share(by_target)
    for target, group in by_target.items():
        decision = decisions[target]
        if isinstance(decision, Open):
            answered += [Asked(claim, action, early=breaker_open(claim, action, decision)) for claim, action in group]
    return answered
