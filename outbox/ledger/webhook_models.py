"""The ledger's table of the provider's webhook events, and the indexes that find an event's operation.
On ``models.Base``'s metadata (outbox/ledger/__init__.py imports this module), so a new ledger has them.

- ``outbox_webhook_events``: one row per verified event (a forged or stale one is refused before
  anything is stored), unique per (target, whose secret verified it, event id): the provider's retry
  of an event it already delivered finds its row and changes nothing, and so does a captured request
  posted again under another path that secret verifies. ``disposition`` says what the ledger did with
  it; ``no_operation`` ones are the reconciliation report's "document without record", until an
  operation takes them (outbox/evidence/stored_events.py: by the reference or key they carry, indexed
  among the unmatched events only).
- An event names its operation by the key the provider saw (``outbox_operations.provider_key``) or
  by the provider's reference recorded on it (``result_reference``): both indexed, the reference only
  where one is recorded.
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import CheckConstraint, DateTime, Index, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from outbox.ledger.models import BIGID, OPERATIONS, PREFIX, Base, Operation

WEBHOOK_EVENTS = PREFIX + "webhook_events"

Index(f"ix_{OPERATIONS}_provider_key", Operation.provider_key)
Index(
    f"ix_{OPERATIONS}_result_reference",
    Operation.result_reference,
    postgresql_where=text("result_reference IS NOT NULL"),
    sqlite_where=text("result_reference IS NOT NULL"),
)


class Disposition(str, enum.Enum):
    """What the ledger did with a verified event. The database's CHECK lists the same words."""

    SETTLED = "settled"  # it moved its operation (a success: evidence wins; at once, or when the reconciler claimed it)
    RECORDED = "recorded"  # its operation was found; nothing to move (pending, already settled, in flight)
    NO_OPERATION = "no_operation"  # no operation has its key or reference: a document without record
    AMBIGUOUS = "ambiguous"  # several operations have its key or reference: none is moved
    IGNORED = "ignored"  # no action of the target maps its type

    def __str__(self) -> str:
        return self.value


UNMATCHED = (Disposition.NO_OPERATION.value, Disposition.AMBIGUOUS.value)
_DISPOSITIONS = ", ".join(f"'{d.value}'" for d in Disposition)
_UNMATCHED = "disposition IN (" + ", ".join(f"'{d}'" for d in UNMATCHED) + ")"


class WebhookEvent(Base):
    """A verified webhook event: who sent it, what it named, what the ledger did with it. Never the
    payload (it may hold personal data): its digest, and the fields that named the operation."""

    __tablename__ = WEBHOOK_EVENTS

    id: Mapped[int] = mapped_column(BIGID, primary_key=True, autoincrement=True)
    target: Mapped[str] = mapped_column(String(200))
    # The endpoint it came to: '' for the target's own (/v1/webhooks/<target>), else the tenant of
    # /v1/webhooks/<target>/<tenant>, whose secret verified it.
    scope: Mapped[str] = mapped_column(String(128))
    # Whose secret verified it: '' the target's (webhooks.secret), else the tenant's whose own
    # webhook_secret did. The dedupe key with target and event_id (not the path it came to).
    verified_by: Mapped[str] = mapped_column(String(128))
    # The provider's event id (webhook-id; a Stripe event's id): a retry carries the same.
    event_id: Mapped[str] = mapped_column(String(255))
    event_type: Mapped[str] = mapped_column(String(200))
    scheme: Mapped[str] = mapped_column(String(16))
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # The time the provider signed it (webhook-timestamp, Stripe-Signature's t).
    signed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    body_digest: Mapped[str] = mapped_column(String(64))  # sha256 of the raw body as received
    # What the mapping that named its operation (or, none named, the first that maps its type) reads:
    # succeeded / failed / pending; NULL: no action maps its type (ignored).
    outcome: Mapped[str | None] = mapped_column(String(16))
    action: Mapped[str | None] = mapped_column(String(200))
    provider_key: Mapped[str | None] = mapped_column(String(255))  # the key the object carried
    reference: Mapped[str | None] = mapped_column(String(255))  # the provider's reference it carried
    operation_id: Mapped[str | None] = mapped_column(String(36))
    tenant: Mapped[str | None] = mapped_column(String(128))  # its operation's tenant (or the endpoint's)
    disposition: Mapped[str] = mapped_column(String(16))
    moved_to: Mapped[str | None] = mapped_column(String(32))  # the status it moved its operation to
    note: Mapped[str | None] = mapped_column(Text)  # why, for people

    __table_args__ = (
        UniqueConstraint("target", "verified_by", "event_id"),
        CheckConstraint(f"disposition IN ({_DISPOSITIONS})", name="disposition"),
        Index(f"ix_{WEBHOOK_EVENTS}_operation_id", "operation_id"),
        # The report's "document without record": only the events no operation took are indexed.
        Index(
            f"ix_{WEBHOOK_EVENTS}_unmatched",
            "received_at",
            postgresql_where=text(_UNMATCHED),
            sqlite_where=text(_UNMATCHED),
        ),
        # An event no operation took yet, found again by the operation its reference or key names.
        *(
            Index(
                f"ix_{WEBHOOK_EVENTS}_unmatched_{column}",
                column,
                postgresql_where=text(_UNMATCHED),
                sqlite_where=text(_UNMATCHED),
            )
            for column in ("reference", "provider_key")
        ),
    )
