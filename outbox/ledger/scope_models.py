"""The ledger's tables for agents' calls: which operation holds a business object, and what a
conversation has spent of its budgets; and the partial indexes that find an object's or a scope's
operations. On ``models.Base``'s metadata (models.py imports this module), so a new ledger has them.

- ``outbox_operations.object_key``: the business object an intent touches (the action's ``object``
  template, rendered at submit): while one operation on it may have taken effect unseen, the next
  waits (outbox/ledger/objects.py).
- ``outbox_operations.budget_scope``: the conversation whose budget it was charged to
  (outbox/ledger/budget_scopes.py); NULL: none.
- ``outbox_budget_charges``: one row per dispatch attempt charged to its conversation's retry budget
  (outbox/ledger/budget_charges.py): the attempt's id is the key, so a charge asked twice is made once.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import BigInteger, DateTime, Index, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from outbox.ledger.models import BIGID, OPERATIONS, PREFIX, Base, Operation

OBJECT_HOLDS = PREFIX + "object_holds"
BUDGET_SCOPES = PREFIX + "budget_scopes"
BUDGET_CHARGES = PREFIX + "budget_charges"

# Only operations that name an object or a budget scope are indexed (most name neither).
Index(
    f"ix_{OPERATIONS}_object",
    Operation.tenant,
    Operation.object_key,
    postgresql_where=text("object_key IS NOT NULL"),
    sqlite_where=text("object_key IS NOT NULL"),
)
Index(
    f"ix_{OPERATIONS}_budget_scope",
    Operation.tenant,
    Operation.budget_scope,
    postgresql_where=text("budget_scope IS NOT NULL"),
    sqlite_where=text("budget_scope IS NOT NULL"),
)


class ObjectHold(Base):
    """Which operation holds a business object (outbox/ledger/objects.py): the last one let through to
    send on it. Another may take it over only once the holder's outcome is known."""

    __tablename__ = OBJECT_HOLDS

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    object_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    operation_id: Mapped[str] = mapped_column(String(36))
    taken_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ScopeSpend(Base):
    """What one conversation (a budget scope) has spent of one budget: an action's, or every tool's
    (bucket '*'). Charged at submit by one conditional upsert against its ScopeLimit
    (outbox/ledger/budget_scopes.py)."""

    __tablename__ = BUDGET_SCOPES

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    scope: Mapped[str] = mapped_column(String(255), primary_key=True)
    bucket: Mapped[str] = mapped_column(String(200), primary_key=True)
    calls: Mapped[int] = mapped_column(Integer)
    # The sum of the action's amount argument, in millionths of its unit (exact, summable in SQL).
    amount_micros: Mapped[int] = mapped_column(BigInteger)
    # Dispatch attempts beyond each call's first, charged right before each leaves
    # (outbox/ledger/budget_charges.py): what max_retry_billed bounds.
    retry_billed: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    opened_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class BudgetCharge(Base):
    """One dispatch attempt charged to its conversation's retry budget (outbox/ledger/budget_charges.py),
    keyed by the attempt's row: the charge of an attempt is made once, however often it is asked."""

    __tablename__ = BUDGET_CHARGES

    # Not a serial: the attempt row's own id.
    attempt_id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=False)
    operation_id: Mapped[str] = mapped_column(String(36))
    tenant: Mapped[str] = mapped_column(String(128))
    scope: Mapped[str] = mapped_column(String(255))
    charged_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
