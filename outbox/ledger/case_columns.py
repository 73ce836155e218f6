"""The columns of a handoff as a case, and of an operation's "retry as a new intent" links.

Mixins of ``models.Handoff`` and ``models.Operation`` (migration 0022 adds them): outbox/evidence/checks.py,
rechecks.py and handoffs.py say what they hold and when they are written; retries.py the links.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, DateTime, String
from sqlalchemy.orm import Mapped, mapped_column

TS = DateTime(timezone=True)


class HandoffCaseColumns:
    # Who took the case: an identity (``key:<id>`` for an API key or a console session of it,
    # ``cli:<account>`` for the command line), never free text; and when.
    owner: Mapped[str | None] = mapped_column(String(255))
    taken_at: Mapped[dt.datetime | None] = mapped_column(TS)
    # When the reconciler asks the provider again (NULL: not re-checked, by design or no longer), and
    # until when a lookup by key proves something (the provider's key retention from the first attempt).
    next_check_at: Mapped[dt.datetime | None] = mapped_column(TS)
    checks_until: Mapped[dt.datetime | None] = mapped_column(TS)
    # The attempt row whose evidence resolved it (a re-check, a late success, a webhook); NULL: a person.
    evidence_attempt_id: Mapped[int | None] = mapped_column(BigInteger)


class RetryLinkColumns:
    # The operation a person replaced with this one (a new intent under a derived key), and the one
    # that replaced it: linked both ways.
    retry_of: Mapped[str | None] = mapped_column(String(36))
    retried_as: Mapped[str | None] = mapped_column(String(36))
