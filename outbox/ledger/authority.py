"""Authority re-checked when work continues: who may no longer act, as each process of the fleet sees it.

"Authorized yesterday does not mean authorized today." Two kinds of facts take authority back, both
rare and both small: an API key revoked (``outbox_api_keys.revoked_at``: nothing more leaves in the
name of the intents it submitted, and its approvals stop counting) and a subject stopped
(``outbox_subject_stops``: an operator's emergency stop of one agent). A process reads them all at
once, at most every ``REFRESH_S`` per ledger, and answers every question from that snapshot: a submit
of a stopped subject is refused (outbox/ledger/stops.py), a claimed intent whose submitting key was
revoked or whose subject is stopped is not sent (workers/engine/authority.py). The hot path pays a
dictionary lookup, never a query per operation: "within seconds" is the promise. What the operator's
own command finds queued is moved in its transaction (outbox/ledger/stops.py, outbox/access/revocation.py),
so that part is exact.

A snapshot that cannot be read again is trusted for ``TRUST_S``; after that nothing is sent on it
(the caller fails closed), which is what lets a revocation park its key's queued intents for only
``SETTLE_S``: by then every worker that may send knows.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc
from outbox.ledger.models import ApiKey
from outbox.ledger.stop_models import SubjectStop

log = logging.getLogger(__name__)

# A worker re-reads who may act at most this often: a stop or a revocation holds the fleet's sends
# within about a second, for one query pair per process and ledger per second.
REFRESH_S = 1.0
# A snapshot that cannot be read again (the ledger away) is used this long; after it nothing is
# sent on it. Three refreshes: a blip does not stall sends, a long outage does not send on old facts.
TRUST_S = 3.0
# What a revocation parks its key's queued intents for: longer than TRUST_S, so that when they come
# due again every process that may claim them has read the revocation (and none sends them).
SETTLE_S = TRUST_S + 1.0


def identity_of_key(key_id: int) -> str:
    """The identity an API key stands for (``submitted_by``, ``approver_identity``): ``key:<id>``."""
    return f"key:{key_id}"


def _iso(at: dt.datetime) -> str:
    return at.isoformat(timespec="seconds")


@dataclass(frozen=True)
class Revocation:
    """An API key taken back: when, by whom, and what becomes of the intents it submitted that have
    not left (``cancels_queued``: cancelled; otherwise a person decides)."""

    identity: str
    at: dt.datetime
    by: str | None
    cancels_queued: bool

    def describe(self) -> str:
        return f"the submitting key {self.identity} was revoked at {_iso(self.at)}" + (
            f" by {self.by}" if self.by else ""
        )


@dataclass(frozen=True)
class Stop:
    """An operator's emergency stop of one subject in one tenant."""

    tenant: str
    subject: str
    by: str
    at: dt.datetime
    reason: str | None

    def describe(self) -> str:
        said = f"subject {self.subject!r} of tenant {self.tenant} was stopped by {self.by} at {_iso(self.at)}"
        return said + (f" ({self.reason})" if self.reason else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "subject": self.subject,
            "stopped_by": self.by,
            "stopped_at": self.at.isoformat(),
            "reason": self.reason,
        }

    @classmethod
    def of(cls, row: SubjectStop) -> Stop:
        at = as_utc(row.stopped_at)
        assert at is not None
        return cls(row.tenant, row.subject, row.stopped_by, at, row.reason)


@dataclass(frozen=True)
class Snapshot:
    """Who may no longer act, as read at ``read_at`` (this process's monotonic clock)."""

    revoked: Mapping[str, Revocation] = field(default_factory=dict)
    stops: Mapping[tuple[str, str], Stop] = field(default_factory=dict)
    read_at: float = 0.0

    def revocation_of(self, identity: str | None) -> Revocation | None:
        return self.revoked.get(identity) if identity is not None and self.revoked else None

    def stop_of(self, tenant: str, subject: str) -> Stop | None:
        return self.stops.get((tenant, subject)) if self.stops else None


def read_snapshot(session: Session, *, clock: Callable[[], float] = time.monotonic) -> Snapshot:
    """Every revoked key and every stop, now (two small queries)."""
    read_at = clock()
    revoked = {}
    keys = select(ApiKey.id, ApiKey.revoked_at, ApiKey.revoked_by, ApiKey.revoke_cancels_queued).where(
        ApiKey.revoked_at.is_not(None)
    )
    for key_id, revoked_at, by, cancels in session.execute(keys):
        at = as_utc(revoked_at)
        assert at is not None
        identity = identity_of_key(key_id)
        revoked[identity] = Revocation(identity, at, by, bool(cancels))
    stops = {}
    columns = (
        SubjectStop.tenant,
        SubjectStop.subject,
        SubjectStop.stopped_by,
        SubjectStop.stopped_at,
        SubjectStop.reason,
    )
    for tenant, subject, by, stopped_at, reason in session.execute(select(*columns)):
        at = as_utc(stopped_at)
        assert at is not None
        stops[(tenant, subject)] = Stop(tenant, subject, by, at, reason)
    return Snapshot(revoked, stops, read_at)


class AuthorityBoard:
    """One process's view of one ledger's authority: read again when older than ``refresh_s``, one
    thread reading while the others wait for it."""

    def __init__(
        self, *, refresh_s: float = REFRESH_S, trust_s: float = TRUST_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.refresh_s, self.trust_s, self.clock = refresh_s, trust_s, clock
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()

    def current(self, read: Callable[[], Snapshot]) -> Snapshot:
        """The snapshot, read again (``read``) if it is older than ``refresh_s``. Raises what ``read``
        raised when no snapshot younger than ``trust_s`` is at hand: the caller must not act on it."""
        snap = self._snapshot
        if snap is not None and self.clock() - snap.read_at < self.refresh_s:
            return snap
        with self._lock:
            snap = self._snapshot
            if snap is not None and self.clock() - snap.read_at < self.refresh_s:
                return snap  # another thread read it meanwhile
            try:
                self._snapshot = read()
            except Exception as exc:
                if snap is None or self.clock() - snap.read_at >= self.trust_s:
                    raise
                log.warning("who may act could not be read again (%s): the last reading is used", type(exc).__name__)
                return snap
            return self._snapshot

    def forget(self) -> None:
        """This process changed authority itself (a stop, a resume, a revocation): read it again next time."""
        self._snapshot = None


_BOARDS: dict[str, AuthorityBoard] = {}
_BOARDS_LOCK = threading.Lock()


def board_for(bind: Any) -> AuthorityBoard:
    """The process's board of the ledger ``bind`` (an engine, connection or session) is on."""
    if isinstance(bind, Session):
        bind = bind.get_bind()
    engine = getattr(bind, "engine", bind)
    name = engine.url.render_as_string(hide_password=True)
    with _BOARDS_LOCK:
        board = _BOARDS.get(name)
        if board is None:
            board = _BOARDS[name] = AuthorityBoard()
        return board


def snapshot_in(session: Session) -> Snapshot:
    """This process's snapshot of the session's ledger, read in the session if it is due again."""
    return board_for(session).current(lambda: read_snapshot(session))
