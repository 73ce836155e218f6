"""The ledger's table of emergency stops: which subject (an agent) of which tenant an operator stopped.

On ``models.Base``'s metadata (outbox/ledger/__init__.py imports this module), so a new ledger has it.

- ``outbox_subject_stops``: one row per stopped (tenant, subject), deleted when it is resumed. While it
  is there, new intents of the subject are refused at submit and its unsent intents are held
  (outbox/ledger/stops.py); who stopped it, when and why are the row. A handful of rows: every worker
  reads the whole table once a second (outbox/ledger/authority.py).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import DateTime, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from outbox.ledger.models import PREFIX, Base

SUBJECT_STOPS = PREFIX + "subject_stops"


class SubjectStop(Base):
    """An operator's emergency stop of one subject in one tenant (``agent-outbox subjects stop``)."""

    __tablename__ = SUBJECT_STOPS

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    subject: Mapped[str] = mapped_column(String(255), primary_key=True)
    stopped_by: Mapped[str] = mapped_column(String(255))
    stopped_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    reason: Mapped[str | None] = mapped_column(Text)
