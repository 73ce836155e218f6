"""The columns that say who may still act: how an API key was revoked, and which key gave an approval.

Mixins of ``models.ApiKey`` and ``models.Approval`` (migration 0019 adds them). Authority is
re-checked when work continues (outbox/ledger/authority.py): an intent whose submitting key was
revoked is not sent, and an approval given with a key revoked since no longer counts.
"""

from __future__ import annotations

from sqlalchemy import Boolean, String, false
from sqlalchemy.orm import Mapped, mapped_column


class RevocationColumns:
    # Who revoked the key (NULL: not revoked, or revoked before 0019), and what its revocation says of
    # the intents it submitted that have not left yet: cancelled (true) or handed to a person (false).
    revoked_by: Mapped[str | None] = mapped_column(String(255))
    revoke_cancels_queued: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)


class ApproverIdentityColumns:
    # The identity that approved (``key:<id>``: an API key, or a console session of it), which a
    # revocation takes back; NULL: a person at the command line, whom no key vouches for.
    approver_identity: Mapped[str | None] = mapped_column(String(255))
