"""When a handoff's provider is asked again: the slowing schedule of its re-checks, and until when.

A handoff whose outcome a provider's answer could settle (an ambiguous attempt, the lookup down, an
index that lags) keeps being looked up while it waits for a person (outbox/evidence/rechecks.py):
first after ``first_s``, then each time after as long again as the case has been open (doubling:
minutes, then hours), never more than ``max_s`` apart, with a little jitter so that the handoffs of
one outage do not all ask at the same moment.

Until when: a lookup by key proves something only while the provider remembers the key, so re-checks
end at the provider's key retention (the action's ``provider_idempotency.retention_s``) counted from
the first attempt that may have reached it. An action without provider keys is looked up by a
business reference, which no key retention bounds; its re-checks end after ``without_keys_s``
(OUTBOX_HANDOFF_RECHECK_WITHOUT_KEYS_S): long enough for any outage or index lag, short enough that a
case nobody resolves does not cost lookups for ever.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc
from outbox.ledger.models import Attempt, Operation
from outbox.ledger.states import AttemptKind

# Defaults of the settings OUTBOX_HANDOFF_RECHECK_FIRST_S / _MAX_S / _WITHOUT_KEYS_S (outbox/settings.py).
FIRST_S = 60.0  # a minute: an outage that spent the reconciler's budget is often over by then
MAX_S = 6 * 3600.0  # at most four checks a day once the case is old: cheap, and soon enough for a person
WITHOUT_KEYS_S = 7 * 86400.0  # a week of looking by reference: past any outage or index lag worth waiting for
JITTER = 0.1  # each delay is shortened by up to this share, at random


@dataclass(frozen=True)
class RecheckTerms:
    """How a deployment re-checks its handoffs (the three settings above)."""

    first_s: float = FIRST_S
    max_s: float = MAX_S
    without_keys_s: float = WITHOUT_KEYS_S


@dataclass(frozen=True)
class Recheck:
    """A new handoff's re-checks: the first after ``first_s``; none after ``horizon_s`` from the first
    attempt that may have reached the provider (its key retention, or ``without_keys_s``)."""

    first_s: float
    horizon_s: float


def plan(terms: RecheckTerms, retention_s: float | None) -> Recheck:
    """The re-checks of a handoff of an action that can be looked up (``retention_s``: its provider's
    key retention; None: it declares no provider keys)."""
    return Recheck(terms.first_s, retention_s if retention_s is not None else terms.without_keys_s)


def next_check_in_s(age_s: float, terms: RecheckTerms, rng: random.Random) -> float:
    """The wait before the next check of a case open for ``age_s``: as long again, within
    [first_s, max_s], shortened by up to JITTER at random."""
    delay = min(max(age_s, terms.first_s), terms.max_s)
    return delay * (1.0 - JITTER * rng.random())


def next_check(
    now: dt.datetime, opened_at: dt.datetime, until: dt.datetime | None, terms: RecheckTerms, rng: random.Random
) -> dt.datetime | None:
    """When to ask next (None: no more re-checks, the provider's key retention is over); never after
    ``until``, so the last check falls on the last moment a lookup by key still proves something."""
    if until is not None and now >= until:
        return None
    at = now + dt.timedelta(seconds=next_check_in_s((now - opened_at).total_seconds(), terms, rng))
    return min(at, until) if until is not None else at


def first_sent_at(session: Session, operation_id: str) -> dt.datetime | None:
    """When the first dispatch attempt that may have reached the provider started (those up to
    ``proven_absent_through`` were proven unable to: the key's life there began with the next one)."""
    proven = select(Operation.proven_absent_through).where(Operation.id == operation_id).scalar_subquery()
    first = session.execute(
        select(func.min(Attempt.started_at)).where(
            Attempt.operation_id == operation_id,
            Attempt.kind == AttemptKind.DISPATCH.value,
            Attempt.attempt_number > func.coalesce(proven, 0),
        )
    ).scalar()
    return as_utc(first)
