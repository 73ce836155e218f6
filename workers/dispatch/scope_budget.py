"""A retry's charge to its conversation, right before it leaves (outbox/ledger/budget_charges.py).

Asked by fan-out after the breaker, the limits and the checks let the attempt through and before
anything is sent: nothing for a first attempt or an operation without a scope (no statement). The
charge is its own short transaction, committed before the send. A scope without room ends the
operation as a spent budget does (outcomes.spent): failed_before_commit ("the conversation's budget
is spent", what was spent) only when nothing it sent can have taken effect; otherwise outcome_unknown,
where lookups settle it (the reconciler asks the scope again before it would send it once more), or a
person. A ledger that does not answer the charge sends nothing either: the attempt is refunded and
tried again shortly (asked again for the same attempt, a charge that did commit is not made twice).
"""

from __future__ import annotations

import logging
import time

from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.budget_charges import STALE, Spent, charge_attempt, needs_charge
from outbox.ledger.claims import Claim
from workers.engine.outcomes import AttemptOutcome, RetryAt, spent
from workers.ground.outage import OUTAGES
from workers.provider.actions import ActionConfig, ActionsFile

log = logging.getLogger(__name__)

# A charge that met a ledger error is asked once more after this pause (the same attempt: a charge
# that committed is found, not made twice); then the attempt is sent back without being sent.
CHARGE_AGAIN_S = 0.2
# How soon an attempt whose charge could not be made is tried again: the ledger is likely back by then.
CHARGE_RETRY_S = 2.0


def charge_before_send(
    sessions: sessionmaker[Session] | None, actions: ActionsFile, claim: Claim, action: ActionConfig
) -> AttemptOutcome | None:
    """None: the attempt may leave (charged, or nothing to charge); else what it leads to instead."""
    if sessions is None or claim.budget_scope is None:
        return None
    budgets = actions.budgets_of(claim.action)
    if not needs_charge(budget_scope=claim.budget_scope, attempt_count=claim.attempt_count, budgets=budgets):
        return None
    for tries_left in (1, 0):
        try:
            with sessions.begin() as session:
                got = charge_attempt(
                    session,
                    tenant=claim.tenant,
                    scope=claim.budget_scope,
                    operation_id=claim.operation_id,
                    attempt_id=claim.attempt_id,
                    fencing_token=claim.fencing_token,
                    budgets=budgets,
                )
            break
        except OUTAGES as exc:
            if tries_left:
                time.sleep(CHARGE_AGAIN_S)
                continue
            why = f"the conversation's budget could not be charged ({type(exc).__name__}): not sent, tried again"
            log.info("%s", why, extra=claim.log_fields())
            return RetryAt(CHARGE_RETRY_S, why, refund_attempt=True)
    if got is STALE:
        # Another worker owns the operation now: our finalize will be refused as stale too.
        return RetryAt(0.0, "another worker owns it now: not sent", refund_attempt=True)
    if isinstance(got, Spent):
        log.info("retry not sent: %s", got.why, extra=claim.log_fields() | {"budget_scope": claim.budget_scope})
        return spent(claim, action, got.why)
    return None
