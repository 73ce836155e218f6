"""The console's session cookie and CSRF tokens: HMAC-signed, expiring, bound to an API key.

The cookie holds ``{key_id}.{expires}.{nonce}.{signature}``, never the key itself; each request
checks the signature, the expiry and that the key is still not revoked (one query). The CSRF token
of a session is an HMAC of its cookie: a form posted without it (or with another session's) is
refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.access.keys import Caller
from outbox.ledger.models import ApiKey

COOKIE = "outbox_console"
CONSOLE_SCOPES = frozenset({"operate", "approve"})


@dataclass(frozen=True)
class Signer:
    secret: bytes

    @classmethod
    def of(cls, configured: str | None) -> Signer:
        return cls((configured or secrets.token_hex(32)).encode())

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def issue(self, key_id: int, *, lifetime_s: float) -> str:
        body = f"{key_id}.{int(time.time() + lifetime_s)}.{secrets.token_hex(8)}"
        return f"{body}.{self._mac(body)}"

    def key_id(self, cookie: str | None) -> int | None:
        """The key a valid, unexpired cookie stands for; None otherwise."""
        if not cookie or cookie.count(".") != 3:
            return None
        body, _, mac = cookie.rpartition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(body).encode()):  # bytes: any input, no TypeError
            return None
        key_id, expires, _ = body.split(".")
        if not key_id.isdigit() or not expires.isdigit() or int(expires) < time.time():
            return None
        return int(key_id)

    def csrf(self, cookie: str) -> str:
        return self._mac("csrf:" + cookie)[:40]

    def csrf_ok(self, cookie: str | None, token: str | None) -> bool:
        return bool(cookie and token) and hmac.compare_digest(self.csrf(cookie or "").encode(), (token or "").encode())

    def flash(self, text: str) -> str:
        """A message the console itself shows after a redirect: signed, so a crafted link cannot put
        its own words in the console's alert boxes."""
        return self._mac("flash:" + text)[:24]

    def flash_ok(self, text: str | None, mac: str | None) -> bool:
        return bool(text and mac) and hmac.compare_digest(self.flash(text or "").encode(), (mac or "").encode())


def caller_of(session: Session, key_id: int) -> Caller | None:
    """The key's caller if it is not revoked and may use the console."""
    row = session.execute(select(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))).scalar_one_or_none()
    if row is None:
        return None
    scopes = frozenset(row.scopes.split(","))
    return Caller(row.id, row.tenant, scopes) if scopes & CONSOLE_SCOPES else None
