"""Which attempts keep an operation from saying "no effect happened".

``failed_before_commit`` and ``cancelled`` claim that the provider holds no effect. The ledger
refuses to enter them while any attempt of the operation says otherwise:

- **confirmed**: an attempt of any kind (dispatch or lookup), stale or not, holds the provider's
  2xx. Evidence wins: a worker that lost its lease and still got the provider's confirmation
  proves the effect happened (outbox/evidence/late_successes.py applies it).
- **may still land**: a dispatch attempt that was ambiguous or never reported (its worker froze,
  crashed or lost its answer), numbered after ``proven_absent_through``. A lookup's "not found"
  proves nothing against such a request: a paused process or a provider's queue can deliver it
  after the lookup, and no timeout bounds that. Only proof that it can no longer land advances
  ``proven_absent_through``: a lookup that carried a newer fencing token to a provider that fences
  (``provider_fencing``), the provider's own record of the key as failed, or a person's decision.

One spelling of each condition, for both dialects, as SQL over the attempts table aliased ``a``;
``op`` names the operations row in the enclosing statement.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from outbox.ledger.models import ATTEMPTS, OPERATIONS

_CONFIRMED = "a.attempt_class = 'succeeded'"


def may_still_land(op: str) -> str:
    """True for a dispatch attempt ``a`` of ``op`` that was ambiguous or never reported and is not
    proven unable to land."""
    return (
        f"(a.kind = 'dispatch' AND a.attempt_number > {op}.proven_absent_through"
        " AND a.attempt_class IN ('ambiguous', 'pending'))"
    )


def may_have_taken_effect(op: str) -> str:
    """True for an attempt ``a`` of ``op`` that is confirmed or may still land."""
    return f"({_CONFIRMED} OR {may_still_land(op)})"


def _none(op: str, condition: str) -> str:
    # :attempt_id is the caller's own attempt (its class is the one being written), 0 for none.
    return f"NOT EXISTS (SELECT 1 FROM {ATTEMPTS} a WHERE a.operation_id = {op}.id AND a.id <> :attempt_id AND {condition})"


# For a worker or a cancel: nothing may have taken effect.
NO_EFFECT_POSSIBLE = _none(OPERATIONS, may_have_taken_effect(OPERATIONS))
# For a settlement that itself proves every attempt unable to land (and writes that proof in the
# same statement): only a confirmation can still contradict it.
NO_EFFECT_CONFIRMED = _none(OPERATIONS, _CONFIRMED)


def no_effect_possible(*, excluding_attempt: int = 0) -> Any:
    """NO_EFFECT_POSSIBLE as a clause for an UPDATE of the operations table built with SQLAlchemy."""
    return text(NO_EFFECT_POSSIBLE).bindparams(attempt_id=excluding_attempt)


def no_effect_confirmed(*, excluding_attempt: int = 0) -> Any:
    return text(NO_EFFECT_CONFIRMED).bindparams(attempt_id=excluding_attempt)
