"""The reconciler: settle outcome_unknown by asking the provider, never by re-sending.

A reconcile doorbell: late successes first (evidence wins), then a claim of due lookups (the
doorbell's ids, topped up with whatever else is due), the breaker asked once per target, and the
lookups handed to the process's lookup threads (lookups_in_flight.py), which judge each answer
(judge.py) and settle whatever has arrived in one transaction (settle.py).

Every lookup carries the reconciler's fencing token (newer than every dispatch attempt's): a
provider that fences (``provider_fencing``) refuses the older ones from then on. Evidence wins: a
success that a worker got after losing its lease settles the operation (apply_late_successes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from breaker import Open
from outbox.ledger.claims import Claim, claim_unknown
from outbox.ledger.states import AttemptClass, Status
from workers.provider.actions import ActionConfig
from workers.reconcile.judge import Settlement
from workers.reconcile.lookup import Asked, SharedBreakers, breaker_open
from workers.reconcile.settle import late
from workers.wiring.runtime import Runtime

log = logging.getLogger(__name__)


def reconcile_batch(
    rt: Runtime,
    operation_ids: Sequence[str],
    *,
    rng: random.Random | None = None,
    fill_to: int = 0,
    wait: bool = True,
) -> dict[str, Settlement]:
    """A reconcile doorbell's ids: late successes first, then a claim, a lookup each on the
    process's lookup threads (lookups_in_flight.py: overlapped, so a process looks up as many
    operations at once as its room holds), and one transaction that settles whatever has
    arrived (each settlement still guarded by its own token). Returns the settlements made (ids
    settled otherwise are absent); ``wait=False`` (the Celery task) returns at once, with nothing.

    ``fill_to``: the claim takes the doorbell's ids first, then other due outcome_unknown
    operations, oldest first, up to this many in all (the Celery task: OUTBOX_DOORBELL_BATCH). A
    doorbell only says "lookups may be waiting": whatever its ids became (settled, looked up by
    another doorbell's claim), it claims what is due, so a task finds nothing to do only when
    nothing is. Those taken along get no late-success check first: a lookup finds the effect,
    and the ledger's guard refuses "no effect" while a success is on record."""
    rng = rng or random.Random()
    settled = late(rt.recorder(rt.ledger), operation_ids=list(operation_ids)) if operation_ids else {}
    wanted = [op_id for op_id in operation_ids if op_id not in settled]
    size = max(fill_to, len(wanted))
    if not size:
        return {}
    lookups = rt.lookups
    if not lookups.reserve(size, timeout_s=rt.settings.soft_time_limit_s / 2):
        log.info("no room: %d lookup(s) in flight; doorbell left to the relay", lookups.held)
        return {}
    try:
        claims = _claim(rt, wanted, size)
    except BaseException:
        lookups.release(size)
        raise
    lookups.release(size - len(claims))
    if not claims:
        log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
    shared = SharedBreakers({}, {})
    try:
        answered = _ask_breakers_once(rt, claims, shared)
    except BaseException:
        lookups.release(len(claims))
        raise
    not_asked = {a.claim.operation_id for a in answered}
    looking = [c for c in claims if c.operation_id not in not_asked]
    done = lookups.start(looking, shared, rng, answered)
    return done.result() if wait else {}


def _claim(rt: Runtime, wanted: list[str], size: int) -> list[Claim]:
    """The given ids, then whatever else is due up to ``size``: topped up by a second statement
    when some of the ids were no longer claimable (settled, or taken along by another claim)."""
    worker, lease_s = rt.worker_id, rt.settings.lease_s
    with rt.sessions.begin() as session:
        if not wanted:
            return claim_unknown(session, worker=worker, lease_s=lease_s, limit=size)
        claims = claim_unknown(
            session,
            worker=worker,
            lease_s=lease_s,
            operation_ids=wanted,
            limit=len(wanted),
            also_due=size - len(wanted),
        )
        if len(claims) < size:
            claims += claim_unknown(session, worker=worker, lease_s=lease_s, limit=size - len(claims))
    return claims


def reconcile_operation(rt: Runtime, operation_id: str, *, rng: random.Random | None = None) -> Settlement | None:
    """One operation's reconcile doorbell (None: settled by a late success, or nothing to claim)."""
    return reconcile_batch(rt, [operation_id], rng=rng).get(operation_id)


def _ask_breakers_once(rt: Runtime, claims: Sequence[Claim], shared: SharedBreakers) -> list[Asked]:
    """Before the lookups leave: the claims that will not be looked up (an action unknown or
    without a lookup: a person), and the breaker asked once per target. Open: that target's claims
    are looked up later, not now. A probe is given back: the first lookup to ask takes it."""
    answered: list[Asked] = []
    by_target: dict[str, list[tuple[Claim, ActionConfig]]] = {}
    for claim in claims:
        action = rt.actions.actions.get(claim.action)
        if action is None:
            why = f"unknown action {claim.action!r}: cannot look it up"
        elif action.lookup is None:
            why = "no lookup declared for this action: a person must check the provider"
        else:
            by_target.setdefault(action.target, []).append((claim, action))
            continue
        answered.append(
            Asked(claim, action, early=Settlement(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, why))
        )
    for target, group in by_target.items():
        decision = rt.breakers.before_call(target)
        if isinstance(decision, Open):
            answered += [Asked(claim, action, early=breaker_open(claim, action, decision)) for claim, action in group]
        elif decision.probe:
            rt.breakers.release(decision)
        else:
            shared.closed[target] = decision
    return answered
