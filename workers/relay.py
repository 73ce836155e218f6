"""The relay: rings the doorbell for due operations; the sweep's duties ride along.

Each tick (``run_once``):
1. expired leases on ``dispatching`` -> ``outcome_unknown`` (a crashed worker may have sent), and
   late successes a worker wrote but did not live to apply -> settled (outbox/late_evidence.py);
2. due ``not_dispatched`` rows never published, due again (a retry), or published longer ago than
   ``republish_after_s`` (the message was lost: broker restart, crashed consumer) -> ``dispatch``;
3. the same for due ``outcome_unknown`` rows -> ``outcome_unknown`` queue (the reconciler).
Marking ``published_at`` and selecting happen in one statement (SKIP LOCKED on PostgreSQL), so two
relays do not publish the same row in the same window; duplicates would be harmless anyway.

On PostgreSQL it also LISTENs: submit notifies on commit with the operation id as payload, and the
relay rings the doorbell for those ids as they arrive, with no query and no write of its own (one
relay per deployment does this: the holder of an advisory lock; others only poll). Their
``published_at`` is written in bulk by the next tick, for the ids still waiting, so the tick
does not ring them again. While a relay listens, its ticks also leave never-published rows alone
for their first ``NOTIFIED_GRACE_S`` (their notification is on its way or already rung but not yet
marked): without that, under load the ticks raced the listener and rang ~40% of all ids twice
(bench/README.md). The leading relay's ticks ring rows that came due before it began leading at
once: nobody rang those from NOTIFY (submitted while no relay led, or while this one took over).
The ticks (every ``poll_s``) are the backstop for everything else: retries coming due, doorbells
lost, notifications missed while the relay was away. On SQLite it polls.
"""

from __future__ import annotations

import functools
import logging
import select as select_mod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import Engine, or_, select, update
from sqlalchemy.engine import make_url

from outbox import late_evidence
from outbox.clock import db_age_s, db_now
from outbox.db import driver_connection, is_postgres, make_sessionmaker
from outbox.evidence import EvidenceSink, backfill
from outbox.models import Operation, core_table
from outbox.states import Status
from outbox.submit import NOTIFY_CHANNEL
from outbox.transitions import expire_leases
from workers import metrics
from workers.actions import ActionsConfig
from workers.doorbell import Doorbell
from workers.handoff_packet import packet_builder

log = logging.getLogger(__name__)
_OP = core_table(Operation)

BACKFILL_EVERY_S = 5.0  # evidence repair is not urgent, but an operator watches the degraded count
BATCH = 500  # rows per statement: one commit marks a whole burst of submits
# pg_try_advisory_lock key held by the relay that rings doorbells straight from NOTIFY ("relay").
NOTIFY_LEADER_LOCK = 0x72656C6179
# While LISTENing, a tick rings a never-published row only once it has been due this long: the
# NOTIFY path covers fresh rows; the tick is the backstop for notifications that were missed.
# Rows due before the leader began leading get no grace: their notification went to nobody.
NOTIFIED_GRACE_S = 2.0
# The listener waits for notifications at most this long before it looks at stop(): with a long
# poll_s, a stopped relay went on ringing (into a dead deployment's queue) for up to poll_s.
STOP_CHECK_S = 0.2


_PG_MARK_RUNG = """
UPDATE operations SET published_at = clock_timestamp()
WHERE id = ANY(%(ids)s) AND status = 'not_dispatched' AND published_at IS NULL
"""


@functools.lru_cache(maxsize=4)
def _pg_mark_due_sql(status: Status, leased_ok: bool) -> str:
    # %(fresh_grace_s)s: never-published rows younger than this are left to the NOTIFY path, unless
    # they were due before %(leading_since)s (NULL unless this relay leads the NOTIFY path).
    # The status and the limit are literals, not parameters: a prepared statement's generic plan
    # could not use the partial index of that status otherwise, and with LIMIT a parameter it is
    # costed for 10% of the table, so PostgreSQL would plan the statement again on every tick.
    lease = "" if leased_ok else "AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())"
    return f"""
WITH due AS (
    SELECT id FROM operations
    WHERE status = '{status.value}' AND next_attempt_at <= clock_timestamp()
      AND ((published_at IS NULL AND (next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                      OR next_attempt_at < %(leading_since)s::timestamptz))
           OR published_at < next_attempt_at
           OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
      {lease}
    ORDER BY next_attempt_at
    LIMIT {BATCH}
    FOR UPDATE SKIP LOCKED
)
UPDATE operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8
"""


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
        linger_s: float = 0.0,
        embedded_broker_cleanup: Callable[[], object] | None = None,
        evidence_sink: EvidenceSink | None = None,
        actions: ActionsConfig | None = None,
    ) -> None:
        """``actions``: the actions file, for handoff packets (what to mask, where to look) when a
        late success contradicts a final state; without it every argument is masked."""
        self.engine = engine
        self.sessions = make_sessionmaker(engine)
        self.doorbell = doorbell
        self.poll_s = poll_s
        self.republish_after_s = republish_after_s
        self.sweep_every_s = sweep_every_s
        self.linger_s = linger_s
        self._last_sweep = 0.0
        self._cleanup = embedded_broker_cleanup
        self._last_cleanup = 0.0
        # Only a separate evidence database can be down while the ledger is up.
        self._evidence = evidence_sink if evidence_sink is not None and evidence_sink.separate else None
        self._sink = evidence_sink or EvidenceSink(None)
        self._packet = packet_builder(actions)
        self._last_backfill = 0.0
        self.stop_event = threading.Event()
        # Ids rung straight from NOTIFY since the last tick; the tick marks them published.
        self._rung: set[str] = set()
        self._rung_lock = threading.Lock()
        self.leader = False  # holds NOTIFY_LEADER_LOCK: rings doorbells from notifications
        self.listening = False  # a LISTEN connection is up: fresh rows arrive by NOTIFY
        # Database time this relay took the lead (while it leads): it rings every row due later.
        self.leading_since: datetime | None = None

    # -- one tick ---------------------------------------------------------------------------
    def _mark_due(self, status: Status, *, leased_ok: bool) -> list[str]:
        if is_postgres(self.engine):
            rows = self._mark_due_pg(status, leased_ok=leased_ok)
        else:
            rows = self._mark_due_portable(status, leased_ok=leased_ok)
        if status is Status.NOT_DISPATCHED:
            # Relay lag: from the moment a row became due (commit, or retry time) to its doorbell.
            metrics.record_relay_lags(row[1] for row in rows)
        return [row[0] for row in rows]

    def _mark_due_portable(self, status: Status, *, leased_ok: bool) -> Any:
        """SQLite (one writer at a time): select due rows and mark them in one UPDATE."""
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
        stmt = update(_OP).where(_OP.c.id.in_(due.scalar_subquery()))
        with self.sessions.begin() as session:
            return session.execute(
                stmt.values(published_at=db_now()).returning(_OP.c.id, db_age_s(_OP.c.next_attempt_at))
            ).all()

    def _mark_due_pg(self, status: Status, *, leased_ok: bool) -> Any:
        """PostgreSQL: SKIP LOCKED, so two relays never mark the same rows in the same window.

        Plain SQL through the driver: a tick runs beside the NOTIFY listener in this process, and
        building SQLAlchemy constructs held the GIL for milliseconds the listener then waited.
        """
        grace = self.listening and status is Status.NOT_DISPATCHED
        with self.engine.begin() as conn:
            return (
                driver_connection(conn)
                .execute(
                    _pg_mark_due_sql(status, leased_ok),
                    {
                        "republish_after_s": float(self.republish_after_s),
                        "fresh_grace_s": NOTIFIED_GRACE_S if grace else 0.0,
                        "leading_since": self.leading_since,  # None unless leading; moot without grace
                    },
                )
                .fetchall()
            )

    def _mark_rung(self) -> None:
        """published_at for the ids rung from NOTIFY that nobody has claimed yet (one statement)."""
        with self._rung_lock:
            rung, self._rung = list(self._rung), set()
        if not rung:
            return
        with self.engine.begin() as conn:
            if is_postgres(self.engine):
                driver_connection(conn).execute(_PG_MARK_RUNG, {"ids": rung})
                return
            conn.execute(
                update(_OP)
                .where(_OP.c.id.in_(rung), _OP.c.status == Status.NOT_DISPATCHED.value, _OP.c.published_at.is_(None))
                .values(published_at=db_now())
            )

    def ring_notified(self, operation_ids: list[str]) -> int:
        """Ring the doorbell for ids that submit notified (committed, due now). Returns messages sent."""
        fresh = list(dict.fromkeys(operation_ids))
        sent = self.doorbell.ring_dispatch(fresh)
        with self._rung_lock:
            self._rung.update(fresh)
        return sent

    def run_once(self) -> Tick:
        # Doorbells first: they are what a waiting agent's latency is made of; the sweep can wait.
        self._mark_rung()
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
            settled = late_evidence.apply_unapplied(self.sessions, actor="sweep", sink=self._sink, packet=self._packet)
            if settled:
                log.info("late evidence: %d operation(s) settled by a success their worker did not apply", len(settled))
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
        # Ticks run in their own thread: a notification never waits for a tick's statements. The
        # first tick waits for the first LISTEN attempt, so it knows whether fresh rows are the
        # NOTIFY path's (a standby that ticked before listening rang the leader's ids again).
        ticker = threading.Thread(target=self._poll_loop, name="relay-ticks", daemon=True)
        url = make_url(self.engine.url).set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            while not self.stop_event.is_set():
                try:
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                        self.listening = True
                        self._try_lead(conn)
                        if ticker.ident is None:  # not started yet
                            ticker.start()
                        self._listen(conn)
                except psycopg.Error:
                    log.warning("relay lost its LISTEN connection; reconnecting", exc_info=True)
                    if ticker.ident is None:
                        ticker.start()  # no LISTEN: the ticks are the relay (they retry the database)
                    self.stop_event.wait(1.0)
                finally:
                    self.leader = self.listening = False
                    self.leading_since = None
        finally:
            if ticker.ident is not None:
                ticker.join(timeout=10)

    def _listen(self, conn: psycopg.Connection) -> None:
        """Ring doorbells for notified ids (leader only); retry leading every poll_s.

        An id is published at once if nothing was published in the last linger_s; otherwise it
        waits for the end of that window with the ids that arrive meanwhile (or until a full
        doorbell's worth), so a burst costs one broker message per batch, not one per commit.
        """
        last_try = time.monotonic()
        pending: list[str] = []
        last_publish = float("-inf")
        while not self.stop_event.is_set():
            wait_s = self.poll_s if not pending else max(0.0, last_publish + self.linger_s - time.monotonic())
            if select_mod.select([conn.fileno()], [], [], min(wait_s, STOP_CHECK_S))[0]:
                # Drain every pending notification.
                pending += [n.payload for n in conn.notifies(timeout=0) if n.payload and self.leader]
            now = time.monotonic()
            if pending and (len(pending) >= self.doorbell.batch or now - last_publish >= self.linger_s):
                self._safe_ring(pending)
                pending, last_publish = [], now
            if not self.leader and now - last_try >= self.poll_s:
                self._try_lead(conn)
                last_try = time.monotonic()

    def _try_lead(self, conn: psycopg.Connection) -> None:
        # Session-level lock: released when this connection ends, so a standby takes over.
        # The clock is read after LISTEN began: a row due later commits later, so it is notified.
        row = conn.execute("SELECT pg_try_advisory_lock(%s), clock_timestamp()", (NOTIFY_LEADER_LOCK,)).fetchone()
        self.leader = bool(row and row[0])
        if self.leader and row:
            self.leading_since = row[1]
            log.info("relay rings doorbells from NOTIFY (leader)")

    def _safe_ring(self, ids: list[str]) -> None:
        try:
            self.ring_notified(ids)
        except Exception:  # noqa: BLE001 - the next tick rings them (published_at is still empty)
            log.warning(
                "relay could not publish %d notified doorbell(s); the next tick retries", len(ids), exc_info=True
            )
