"""The operation's columns of its action's version and of the request on record under its key, and
the attempt's of the version it was claimed under.

Mixins of ``models.Operation`` and ``models.Attempt`` (outbox/ledger/request_record.py says what
they hold and when they are written; migration 0017 adds the operation's, 0021 the key's header and
the attempt's version).
"""

from __future__ import annotations

from sqlalchemy import String, Text
from sqlalchemy.orm import Mapped, mapped_column


class RequestRecordColumns:
    # The action's version at submit (outbox/actions/versions.py); NULL: the producer had no actions
    # file (or the row predates 0017): its first request that left records the version it was built under.
    action_version: Mapped[str | None] = mapped_column(String(64))
    # The first request that left under its key: every later attempt sends exactly it. request_body
    # and request_path are purged with the arguments (outbox/privacy/retention.py).
    request_version: Mapped[str | None] = mapped_column(String(64))
    request_method: Mapped[str | None] = mapped_column(String(16))
    request_path: Mapped[str | None] = mapped_column(Text)
    request_body: Mapped[str | None] = mapped_column(Text)
    request_digest: Mapped[str | None] = mapped_column(String(64))
    # The header that carried its idempotency key, lower case ("": none; NULL: recorded before 0021).
    request_key_header: Mapped[str | None] = mapped_column(String(255))


class AttemptVersionColumn:
    # A dispatch attempt: the version of the action its worker held when it claimed it, the one its
    # request is built under when none is on record. NULL: a lookup, or claimed before 0021.
    action_version: Mapped[str | None] = mapped_column(String(64))
