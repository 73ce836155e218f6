"""Dispatch: one doorbell's story. Gate, claim, fan out, finalize.

1. gate (gate.py): which rung ids are due; those whose breaker is open are parked, not claimed;
2. claim (outbox/claims.py): the rest, under leases and fresh fencing tokens, topped up with
   whatever else is due;
3. fan out (fan_out.py): one attempt each, concurrently where the target looks healthy;
4. finalize (finalize.py): each outcome becomes exactly one guarded move, in one transaction.

The retry loop is outside (the ledger's next_attempt_at + the relay); the breaker wraps exactly
one HTTP attempt. A read timeout may come after the provider committed: never resend, park in
outcome_unknown and let the reconciler ask the provider by key.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta

from breaker import Allowed, Decision, Open
from outbox import failpoints
from outbox.claims import Claim, claim_due
from workers.fan_out import Batch, attempt_all
from workers.finalize import apply_many
from workers.gate import park_while_open_if_due, read_due_ops
from workers.outcomes import Outcome, deadline_of
from workers.runtime import Runtime

log = logging.getLogger(__name__)


def dispatch_operation(rt: Runtime, operation_id: str) -> Outcome | None:
    """Handle one doorbell for one operation (see dispatch_batch)."""
    return dispatch_batch(rt, [operation_id]).get(operation_id)


def dispatch_batch(rt: Runtime, operation_ids: Sequence[str]) -> dict[str, Outcome]:
    """Handle one doorbell carrying one or more operation ids. Returns the outcomes applied.

    The breaker is asked before the claim: while it is open an operation is not claimed at all
    (no fencing token, no attempt number) and stays not_dispatched until the reopen time. The rest
    are claimed, with whatever else is due up to OUTBOX_DOORBELL_BATCH, called (concurrently, one
    thread each, unless the target answers within FAST_CALL_S: see fan_out.attempt_all and FAST_CALL_S; a batch costs
    the time of its slowest call, which the lease covers) and finalized in one transaction.
    """
    caller, rec = rt.caller(), rt.recorder()
    dues = read_due_ops(rt.ledger, operation_ids)
    if not dues:
        # Duplicate doorbell, not due yet, or already taken: the database decides, nothing to do.
        log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
        return {}
    outcomes: dict[str, Outcome] = {}
    decisions: dict[str, Decision] = {}
    # A closed breaker admits every call: ask it once per target per doorbell, not once per call.
    closed: dict[str, Allowed] = {}
    for op_id, due in dues.items():
        known = rt.actions.actions.get(due.action)
        if known is None:
            continue
        decision = closed.get(known.target) or rt.breakers.before_call(known.target)
        if isinstance(decision, Allowed) and not decision.probe:
            closed[known.target] = decision
        # Past the deadline the claim below ends it (breaker_open -> budget spent).
        if isinstance(decision, Open) and due.clock.now() + timedelta(seconds=decision.wait_s) <= deadline_of(
            due, known
        ):
            parked = park_while_open_if_due(
                rt.sessions,
                op_id,
                known,
                decision,
                actor=rt.worker_id,
                spent_attempts=due.attempt_count,
                now=due.clock.now(),
            )
            if parked is not None:
                outcomes[op_id] = parked
            continue
        decisions[op_id] = decision
    wanted = [op_id for op_id in dues if op_id not in outcomes]
    claims: list[Claim] = []
    if wanted:
        with rt.ledger.one_statement() as session:
            # A doorbell wakes a worker; the database says what is due. Under load the relay rings
            # for one or two ids at a time (it publishes as commits arrive), so the same statement
            # fills the batch with whatever else is due now; those ids' own doorbells will find
            # nothing to claim.
            claims = claim_due(
                session,
                worker=rt.worker_id,
                lease_s=rt.settings.lease_s,
                operation_ids=wanted,
                limit=len(wanted),
                also_due=max(rt.settings.doorbell_batch - len(wanted), 0),
            )
    claimed = {c.operation_id for c in claims}
    for op_id, decision in decisions.items():
        if op_id not in claimed:
            rt.breakers.release(decision)  # a probe we will not send: the next caller probes
    for claim in claims:
        failpoints.hit("dispatch.after_claim", claim.idempotency_key)
    batch = Batch(decisions, closed)
    # Most budget left first here too: after a failed canary each call asks the breaker in turn.
    claims.sort(key=lambda c: c.attempt_count)
    results = attempt_all(caller, claims, batch)
    for decision in batch.succeeded.values():
        # One success per target per doorbell: each failure was recorded as it happened.
        rt.breakers.record(decision, failure=False)
    for claim, _, _, _ in results:
        failpoints.hit("dispatch.after_response", claim.idempotency_key)
    outcomes.update(apply_many(rec, results))
    return outcomes
