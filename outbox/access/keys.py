"""API keys: each belongs to one tenant and carries scopes; only the SHA-256 of a key is stored.

A key is ``ao_`` + 32 random bytes (urlsafe base64); it is shown once, at creation. Verification
hashes what the caller sent and looks the hash up: a leaked ledger does not leak usable keys.
Revoking one takes back its queued intents too (outbox/access/revocation.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.ledger.authority import identity_of_key
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.models import ApiKey

SCOPES = ("submit", "read", "approve", "operate")
PREFIX = "ao_"


@dataclass(frozen=True)
class Caller:
    """Who is calling: the key's id, tenant and scopes."""

    key_id: int
    tenant: str
    scopes: frozenset[str]

    @property
    def identity(self) -> str:
        """The identity recorded as ``submitted_by`` and compared by separation of duties: the key,
        whatever ``subject`` or ``by`` text a request carries (a console session of the key is the key)."""
        return identity_of_key(self.key_id)


def parse_scopes(text: str) -> list[str]:
    scopes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(scopes) - set(SCOPES))
    if not scopes or unknown:
        raise InvalidIntent("--scope", f"use a comma-separated list of {', '.join(SCOPES)} (got {text!r})")
    return sorted(set(scopes), key=SCOPES.index)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, tenant: str, scopes: list[str], name: str | None = None) -> tuple[str, ApiKey]:
    if not tenant or len(tenant) > 128:
        raise InvalidIntent("--tenant", "required, at most 128 characters")
    key = PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        key_hash=_hash(key),
        prefix=key[:10],
        tenant=tenant,
        scopes=",".join(scopes),
        name=name,
        created_at=db_now(),
    )
    session.add(row)
    session.flush()
    return key, row


def verify(session: Session, key: str) -> Caller | None:
    """The caller a presented key stands for; None if unknown or revoked."""
    if not key.startswith(PREFIX):
        return None
    row = session.execute(
        select(ApiKey).where(ApiKey.key_hash == _hash(key), ApiKey.revoked_at.is_(None))
    ).scalar_one_or_none()
    if row is None:
        return None
    return Caller(row.id, row.tenant, frozenset(row.scopes.split(",")))


def list_keys(session: Session) -> list[dict[str, Any]]:
    return [key_json(k) for k in session.execute(select(ApiKey).order_by(ApiKey.id)).scalars()]


def _iso(value: dt.datetime | None) -> str | None:
    v = as_utc(value)
    return v.isoformat() if v is not None else None


def key_json(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "prefix": k.prefix,
        "tenant": k.tenant,
        "scopes": k.scopes.split(","),
        "name": k.name,
        "created_at": _iso(k.created_at),
        "revoked_at": _iso(k.revoked_at),
        "revoked_by": k.revoked_by,
        # What its revocation did to the intents it had queued: cancelled them, or handed them to a person.
        "revoke_cancels_queued": bool(k.revoke_cancels_queued) if k.revoked_at is not None else None,
    }
