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
from collections.abc import Sequence
from datetime import timedelta

from breaker import Allowed, Decision, Open
from outbox.approvals.decisions import Grant, grants
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim, claim_due
from outbox.ledger.envelope import loads_exact
from workers.dispatch.fan_out import Batch
from workers.dispatch.gate import park_while_open_if_due, read_due_ops
from workers.dispatch.outcomes import Outcome, deadline_of
from workers.wiring.runtime import Runtime

log = logging.getLogger(__name__)


def dispatch_operation(rt: Runtime, operation_id: str) -> Outcome | None:
    """Handle one doorbell for one operation and wait for its outcome (see dispatch_batch)."""
    return dispatch_batch(rt, [operation_id]).get(operation_id)


def dispatch_batch(rt: Runtime, operation_ids: Sequence[str], *, wait: bool = True) -> dict[str, Outcome]:
    """Handle one doorbell carrying one or more operation ids. Returns the outcomes applied.

    Room first: a process with OUTBOX_MAX_IN_FLIGHT operations out waits (the broker keeps the
    doorbells, the ledger keeps the work). The breaker is asked before the claim: while it is open
    an operation is not claimed at all (no fencing token, no attempt number) and stays
    not_dispatched until the reopen time. The rest are claimed, with whatever else is due up to
    OUTBOX_DOORBELL_BATCH, and handed to the process's calls in flight (in_flight.py). A doorbell
    whose ids are all taken (a duplicate, or another doorbell's claim took them along) still claims
    whatever else is due: the ledger is the queue, a doorbell only says "work may be waiting".

    ``wait``: return after the calls are finalized (with their outcomes); the Celery task does not
    wait (only the gate's outcomes are returned).
    """
    size = rt.settings.doorbell_batch
    if not rt.in_flight.reserve(size, timeout_s=rt.settings.soft_time_limit_s / 2):
        log.info("no room: %d operation(s) in flight; doorbell left to the relay", rt.in_flight.held)
        return {}
    try:
        outcomes, claims, batch = _gate_and_claim(rt, operation_ids, size)
    except BaseException:
        rt.in_flight.release(size)
        raise
    rt.in_flight.release(size - len(claims))
    done = rt.in_flight.start(claims, batch)
    if wait:
        outcomes.update(done.result())
    return outcomes


def _gate_and_claim(
    rt: Runtime, operation_ids: Sequence[str], size: int
) -> tuple[dict[str, Outcome], list[Claim], Batch]:
    decisions: dict[str, Decision] = {}
    try:
        return _gate_and_claim_deciding(rt, operation_ids, size, decisions)
    except BaseException:
        # A probe taken here and never sent would hold the half-open breaker shut for every
        # process until the probe lock expires (probe_timeout_s): give them back.
        for decision in decisions.values():
            rt.breakers.release(decision)
        raise


def _gate_and_claim_deciding(
    rt: Runtime, operation_ids: Sequence[str], size: int, decisions: dict[str, Decision]
) -> tuple[dict[str, Outcome], list[Claim], Batch]:
    dues = read_due_ops(rt.ledger, operation_ids)
    outcomes: dict[str, Outcome] = {}
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
    if wanted or not dues:
        with rt.ledger.one_statement() as session:
            # A doorbell wakes a worker; the database says what is due. The same statement fills
            # the batch with whatever else is due now (oldest first); those ids' own doorbells
            # will in turn claim whatever is due then.
            claims = claim_due(
                session,
                worker=rt.worker_id,
                lease_s=rt.settings.lease_s,
                operation_ids=wanted or None,
                limit=len(wanted) if wanted else size,
                also_due=max(size - len(wanted), 0) if wanted else 0,
            )
    if not claims:
        log.debug("nothing to claim", extra={"operation_ids": list(operation_ids)})
    _ask_once_for_taken_along(rt, claims, decisions, closed)
    claimed = {c.operation_id for c in claims}
    for op_id, decision in decisions.items():
        if op_id not in claimed:
            rt.breakers.release(decision)  # a probe we will not send: the next caller probes
    batch = Batch(decisions, closed, approvals=_approvals(rt, claims))
    for claim in claims:
        failpoints.hit("dispatch.after_claim", claim.idempotency_key)
    # Most budget left first here too: after a failed canary each call asks the breaker in turn.
    claims.sort(key=lambda c: c.attempt_count)
    return outcomes, claims, batch


def _ask_once_for_taken_along(
    rt: Runtime, claims: Sequence[Claim], decisions: dict[str, Decision], closed: dict[str, Allowed]
) -> None:
    """The operations the claim took along (not rung by this doorbell) have no breaker answer yet:
    ask once per target, as for the rung ones. Unasked, each of their calls asked on its own:
    under issue 14's fault mix two thirds of the claims were such fills (their doorbell's own ids
    taken by others), and the breaker's Redis saw 1.2 admissions per operation instead of ~0.1.
    Open or a probe: left unasked, so each call asks (and one of them probes) as before."""
    asked: set[str] = set()
    for claim in claims:
        known = rt.actions.actions.get(claim.action)
        if known is None or known.target in closed or known.target in asked or claim.operation_id in decisions:
            continue
        asked.add(known.target)
        decision = rt.breakers.before_call(known.target)
        if isinstance(decision, Allowed) and not decision.probe:
            closed[known.target] = decision
        else:
            rt.breakers.release(decision)  # a probe given back: the first call to ask takes it


def _approvals(rt: Runtime, claims: Sequence[Claim]) -> dict[str, Grant | None]:
    """For the claims whose action needs approval for their arguments: the approval on record
    (one query; none at all where no action asks for approvals)."""
    needing = []
    for claim in claims:
        known = rt.actions.actions.get(claim.action)
        if known is not None and known.approval.required != "never" and claim.args:
            if known.approval.applies(loads_exact(claim.args)):
                needing.append(claim.operation_id)
    if not needing:
        return {}
    with rt.sessions() as session:
        found = grants(session, needing)
    return {op_id: found.get(op_id) for op_id in needing}
