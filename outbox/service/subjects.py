"""Emergency stops of subjects (agents), as every surface lists, makes and lifts them, for one tenant.

A stop is per tenant: an operator's key stops its own tenant's subject (the HTTP API and the console
pass the key's tenant); the command line's operator names the tenant (``--tenant``, default
OUTBOX_DEFAULT_TENANT) and lists every tenant's stops. What a stop does is the ledger's
(outbox/ledger/stops.py): held at once what is queued, refused at submit what is new, held at their
claim what comes back, within seconds across the fleet; calls already out finish and settle.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent
from outbox.ledger import stops
from outbox.service.inputs import BY_MAX, NOTE_MAX, written

log = logging.getLogger(__name__)
SUBJECT_MAX = 255  # operations.subject


def listing(session: Session, tenant: str | None) -> list[dict[str, Any]]:
    """The stops in force (``tenant``: that tenant's only; None: every tenant's), oldest first."""
    return [s.as_dict() for s in stops.listing(session, tenant)]


def _vouched(by: str, identity: str | None) -> str:
    """Who acts, as written down: who they said they are, and the identity that vouches for it (an
    API key: room for it is left beside BY_MAX in the column)."""
    return f"{by} ({identity})" if identity else by


def stop(
    session: Session, tenant: str, subject: str, *, by: str, reason: str | None, identity: str | None = None
) -> dict[str, Any]:
    """Stop ``subject`` in ``tenant``: what was stopped, whether now (``new``), and how many queued
    intents were held at once (``held``). ``identity``: who vouches for ``by`` (recorded beside it)."""
    _subject(subject)
    written("--by", by, max_len=BY_MAX, required=True)
    written("--reason", reason, max_len=NOTE_MAX)
    by = _vouched(by, identity)
    done, new, held = stops.stop(session, tenant=_tenant(tenant), subject=subject, by=by, reason=reason or None)
    log.warning(
        "subject stopped: its unsent intents are held, new ones refused",
        extra={"tenant": tenant, "subject": subject, "by": by, "held": held},
    )
    return done.as_dict() | {"stopped": True, "new": new, "held": held}


def resume(session: Session, tenant: str, subject: str, *, by: str, identity: str | None = None) -> dict[str, Any]:
    """Lift the stop of ``subject`` in ``tenant``; its held intents are due at once (``woken``).
    InvalidIntent when it was not stopped and nothing of it is held."""
    _subject(subject)
    written("--by", by, max_len=BY_MAX, required=True)
    by = _vouched(by, identity)
    lifted, woken = stops.resume(session, tenant=_tenant(tenant), subject=subject, by=by)
    if lifted is None and not woken:
        raise InvalidIntent("subject", f"{subject!r} is not stopped in tenant {tenant} (agent-outbox subjects list)")
    log.warning("subject resumed", extra={"tenant": tenant, "subject": subject, "by": by, "woken": woken})
    was = lifted.as_dict() if lifted is not None else {"tenant": tenant, "subject": subject}
    return was | {"stopped": False, "resumed_by": by, "woken": woken}


def _subject(subject: str) -> None:
    written("subject", subject, max_len=SUBJECT_MAX, required=True)


def _tenant(tenant: str) -> str:
    written("--tenant", tenant, max_len=128, required=True)
    return tenant
