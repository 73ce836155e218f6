"""The relay: rings the doorbell for due operations; the sweep's duties ride along.

Each tick (``run_once``):
1. expired leases on ``dispatching`` -> ``outcome_unknown`` (a crashed worker may have sent);
2. due ``not_dispatched`` rows never published, due again (a retry), or published longer ago than
   ``republish_after_s`` (the message was lost: broker restart, crashed consumer) -> ``dispatch``;
3. the same for due ``outcome_unknown`` rows -> ``outcome_unknown`` queue (the reconciler).
Marking ``published_at`` and selecting happen in one statement (SKIP LOCKED on PostgreSQL), so two
relays do not publish the same row in the same window; duplicates would be harmless anyway.

On PostgreSQL it wakes on LISTEN/NOTIFY (submit notifies on commit) and polls as a backstop; on
SQLite it polls.
"""

from __future__ import annotations

import logging
import select as select_mod
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import psycopg
from sqlalchemy import Engine, or_, select, update
from sqlalchemy.engine import make_url

from outbox.clock import db_age_s, db_now
from outbox.db import is_postgres, make_sessionmaker
from outbox.evidence import EvidenceSink, backfill
from outbox.models import Operation
from outbox.states import Status
from outbox.submit import NOTIFY_CHANNEL
from outbox.transitions import expire_leases
from workers import metrics
from workers.doorbell import Doorbell

log = logging.getLogger(__name__)
_OP = Operation.__table__

BACKFILL_EVERY_S = 5.0  # evidence repair is not urgent, but an operator watches the degraded count
BATCH = 500  # rows per statement: one commit marks a whole burst of submits


@dataclass(frozen=True)
class Tick:
    expired: int
    dispatch: int
    reconcile: int

    @property
    def busy(self) -> bool:
        return bool(self.expired or self.dispatch or self.reconcile)


class Relay:
    def __init__(
        self,
        engine: Engine,
        doorbell: Doorbell,
        *,
        poll_s: float = 0.5,
        republish_after_s: float = 30.0,
        sweep_every_s: float = 1.0,
        embedded_broker_cleanup: Optional[Callable[[], object]] = None,
        evidence_sink: Optional[EvidenceSink] = None,
    ) -> None:
        self.engine = engine
        self.sessions = make_sessionmaker(engine)
        self.doorbell = doorbell
        self.poll_s = poll_s
        self.republish_after_s = republish_after_s
        self.sweep_every_s = sweep_every_s
        self._last_sweep = 0.0
        self._cleanup = embedded_broker_cleanup
        self._last_cleanup = 0.0
        # Only a separate evidence database can be down while the ledger is up.
        self._evidence = evidence_sink if evidence_sink is not None and evidence_sink.separate else None
        self._last_backfill = 0.0
        self.stop_event = threading.Event()

    # -- one tick ---------------------------------------------------------------------------
    def _mark_due(self, status: Status, *, leased_ok: bool) -> list[str]:
        pg = is_postgres(self.engine)
        conds = [
            _OP.c.status == status.value,
            _OP.c.next_attempt_at <= db_now(),
            or_(
                _OP.c.published_at.is_(None),
                _OP.c.published_at < _OP.c.next_attempt_at,
                _OP.c.published_at < db_now(-self.republish_after_s),
            ),
        ]
        if not leased_ok:
            conds.append(or_(_OP.c.lease_expires_at.is_(None), _OP.c.lease_expires_at < db_now()))
        due = select(_OP.c.id).where(*conds).order_by(_OP.c.next_attempt_at).limit(BATCH)
        if pg:
            due = due.with_for_update(skip_locked=True)
        stmt = update(_OP).where(_OP.c.id.in_(due.scalar_subquery() if not pg else select(due.cte("due").c.id)))
        with self.sessions.begin() as session:
            rows = session.execute(
                stmt.values(published_at=db_now()).returning(_OP.c.id, db_age_s(_OP.c.next_attempt_at))
            ).all()
        if status is Status.NOT_DISPATCHED:
            # Relay lag: from the moment a row became due (commit, or retry time) to its doorbell.
            metrics.record_relay_lags(row[1] for row in rows)
        return [row[0] for row in rows]

    def run_once(self) -> Tick:
        # Doorbells first: they are what a waiting agent's latency is made of; the sweep can wait.
        dispatch_ids = self._mark_due(Status.NOT_DISPATCHED, leased_ok=True)
        if dispatch_ids:
            self.doorbell.ring_dispatch(dispatch_ids)
        expired = 0
        now = time.monotonic()
        if now - self._last_sweep >= self.sweep_every_s:
            self._last_sweep = now
            with self.sessions.begin() as session:
                expired = len(expire_leases(session))
            if expired:
                log.info("leases expired: %d operation(s) parked in outcome_unknown", expired)
        reconcile_ids = self._mark_due(Status.OUTCOME_UNKNOWN, leased_ok=False)
        if reconcile_ids:
            self.doorbell.ring_reconcile(reconcile_ids)
        if self._evidence is not None and now - self._last_backfill >= BACKFILL_EVERY_S:
            self._last_backfill = now
            with self.sessions.begin() as session:
                written, failing = backfill(session, self._evidence)
            if written:
                log.info("evidence backfilled for %d operation(s)", written)
        if self._cleanup is not None and now - self._last_cleanup >= 10:
            self._last_cleanup = now
            self._cleanup()
        return Tick(expired, len(dispatch_ids), len(reconcile_ids))

    # -- loops ------------------------------------------------------------------------------
    def run_forever(self) -> None:
        log.info("relay started (%s)", "LISTEN/NOTIFY + poll" if is_postgres(self.engine) else "polling")
        if is_postgres(self.engine):
            self._listen_loop()
        else:
            self._poll_loop()

    def stop(self) -> None:
        self.stop_event.set()

    def _safe_tick(self) -> Tick:
        try:
            return self.run_once()
        except Exception:  # noqa: BLE001 - the relay must outlive a database or broker blip
            log.warning("relay tick failed; retrying", exc_info=True)
            self.stop_event.wait(min(self.poll_s * 4, 5.0))
            return Tick(0, 0, 0)

    def _poll_loop(self) -> None:
        while not self.stop_event.is_set():
            tick = self._safe_tick()
            if not tick.busy:
                self.stop_event.wait(self.poll_s)

    def _listen_loop(self) -> None:
        url = make_url(self.engine.url).set(drivername="postgresql").render_as_string(hide_password=False)
        while not self.stop_event.is_set():
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self._safe_tick()  # anything committed before we listened
                    while not self.stop_event.is_set():
                        ready = select_mod.select([conn.fileno()], [], [], self.poll_s)[0]
                        if ready:
                            # Drain every pending notification; one tick publishes them all.
                            for _ in conn.notifies(timeout=0):
                                pass
                        tick = self._safe_tick()
                        while tick.dispatch >= BATCH and not self.stop_event.is_set():
                            tick = self._safe_tick()
            except psycopg.Error:
                log.warning("relay lost its LISTEN connection; reconnecting", exc_info=True)
                self.stop_event.wait(1.0)
