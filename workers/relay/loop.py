"""The relay: rings the doorbell for due operations; the sweep's duties ride along.

Each tick (``run_once``):
1. expired leases on ``dispatching`` -> ``outcome_unknown`` (a crashed worker may have sent), and
   late successes a worker wrote but did not live to apply -> settled (outbox/evidence/late_successes.py);
   handoffs whose next check is due -> a reconcile doorbell when none is queued (their re-check);
2. due ``not_dispatched`` rows never published, due again (a retry), or published longer ago than
   ``republish_after_s`` (the message was lost: broker restart, crashed consumer) -> ``dispatch``;
3. runs whose current step settled move on: the next step is submitted, or completed steps are
   compensated, or the run ends (outbox/runs/advance.py);
4. the same for due lookups (``RECONCILE_CLAIMABLE`` rows no reconciler holds) -> ``outcome_unknown``
   queue (the reconciler), with the same backpressure.
Where the relay marks ``published_at`` (the broker's depth unknown), marking and selecting happen
in one statement (SKIP LOCKED on PostgreSQL), so two relays do not publish the same row in the same
window; ringing by count, two relays may name the same rows, which is harmless (the claim decides).

On PostgreSQL it also LISTENs: submit notifies on commit with the operation id as payload, and the
relay rings the doorbell for those ids as they arrive, with no query and no write of its own (one
relay per deployment does this: the holder of an advisory lock; others only poll). While the
broker's depth cannot be read, their ``published_at`` is written in bulk by the next tick, for the
ids still waiting, so the tick does not ring them again; with the depth known the tick rings by
count (below) and writes nothing. While a relay listens, its ticks also leave never-published rows
alone for their first ``NOTIFIED_GRACE_S`` (their notification is on its way or already rung):
without that, under load the ticks race the listener and ring many ids twice.
The leading relay's ticks ring rows that came due before it began leading at
once: nobody rang those from NOTIFY (submitted while no relay led, or while this one took over).
The ticks (every ``poll_s``) are the backstop for everything else: retries coming due, doorbells
lost, notifications missed while the relay was away. On SQLite it polls.

Backpressure: the ledger is the queue, the broker only says "work may be waiting". A worker's
claim takes whatever is due, oldest first, whatever ids its doorbell carried; so what matters is
how many doorbells the broker holds, not which. Each tick reads the dispatch queue's depth and
counts the due rows, and rings only the doorbells missing: one per ``doorbell_batch`` due rows,
never more than ``max_queued`` in the broker (the NOTIFY path checks the same room). Nothing is
re-published because it "looks lost" while the broker still holds enough doorbells: otherwise a
backlog grows a queue of more doorbells than operations waiting, each re-published one looking
lost in turn behind the others. Ringing by count, a tick reads the due rows its doorbells name and
marks none (a mark was one more rewrite of each operation row in a backlog). ``republish_after_s``
and the marks are used only where the depth cannot be read.
"""

from __future__ import annotations

import logging
import select as select_mod
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine

from outbox.evidence.late_successes import apply_unapplied
from outbox.evidence.sinks import EvidenceSink, backfill
from outbox.ledger import publish
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.leases import expire_leases
from outbox.ledger.planner_stats import PlannerStats
from outbox.ledger.publish import count_due, mark_published, mark_published_if_due
from outbox.ledger.states import RECONCILE_CLAIMABLE, Status
from outbox.runs.advance import advance_due
from workers.engine.doorbell import Doorbell
from workers.engine.handoff_packet import packet_builder
from workers.ground import metrics
from workers.ground.heartbeat import Heartbeat
from workers.ground.outage import OUTAGES, OutageReport
from workers.provider.actions import ActionsFile
from workers.relay.gather import Gather

log = logging.getLogger(__name__)

BACKFILL_EVERY_S = 5.0  # evidence repair is not urgent, but an operator watches the degraded count
BATCH = 500  # rows per statement: one commit marks a whole burst of submits
# While LISTENing, a tick rings a never-published row only once it has been due this long: the
# NOTIFY path covers fresh rows; the tick is the backstop for notifications that were missed.
# Rows due before the leader began leading get no grace: their notification went to nobody.
NOTIFIED_GRACE_S = 2.0
# The listener waits for notifications at most this long before it looks at stop(): with a long
# poll_s, a stopped relay went on ringing (into a dead deployment's queue) for up to poll_s.
STOP_CHECK_S = 0.2
# The NOTIFY path reads the queue's depth at most this often (counting its own publishes between).
DEPTH_FRESH_S = 0.05
# While every worker is busy, notified ids wait at most this long for a full doorbell (gather.py).
BUSY_LINGER_S = 0.1


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
        actions: ActionsFile | None = None,
        max_queued: int = 100,
    ) -> None:
        """``actions``: the actions file, for handoff packets (what to mask, where to look) when a
        late success contradicts a final state; without it every argument is masked.
        ``max_queued``: dispatch doorbells the broker may hold (OUTBOX_RELAY_MAX_QUEUED), in the
        queue of this ledger (the doorbell's: a fleet's ledgers each have their own)."""
        self.engine = engine
        self.sessions = make_sessionmaker(engine)
        self.doorbell = doorbell
        self.poll_s = poll_s
        self.republish_after_s = republish_after_s
        self.sweep_every_s = sweep_every_s
        self.linger_s = linger_s
        self.max_queued = max_queued
        # Liveness (OUTBOX_HEARTBEAT_FILE): touched by the ticking loop, whether a tick worked or
        # waits out an outage (workers/ground/heartbeat.py).
        self.heartbeat = Heartbeat.from_env()
        self._depth: int | None = None  # dispatch doorbells in the broker, as last read (+ own since)
        self._depth_read = float("-inf")
        self._depth_seen: int | None = None  # the last reading itself, without our publishes since
        self._last_sweep = 0.0
        self._cleanup = embedded_broker_cleanup
        self._last_cleanup = 0.0
        # Only a separate evidence database can be down while the ledger is up.
        self._evidence = evidence_sink if evidence_sink is not None and evidence_sink.separate else None
        self._sink = evidence_sink or EvidenceSink(None)
        self._packet = packet_builder(actions)
        self._irreversible = (
            frozenset(n for n, a in actions.actions.items() if a.irreversible) if actions else frozenset()
        )
        self._last_backfill = 0.0
        self._planner_stats = PlannerStats(engine)  # a backlog must not run on an empty table's plans
        self.stop_event = threading.Event()
        # Ids rung straight from NOTIFY since the last tick; marked by it only if the depth is unknown.
        self._rung: set[str] = set()
        self._rung_lock = threading.Lock()
        self.leader = False  # holds the NOTIFY-leader lock: rings doorbells from notifications
        self.listening = False  # a LISTEN connection is up: fresh rows arrive by NOTIFY
        # Database time this relay took the lead (while it leads): it rings every row due later.
        self.leading_since: datetime | None = None
        # Ticks and rings failing through a ledger or broker outage; a fleet's relays name their ledger.
        self.name = "relay" if doorbell.ledger is None else f"relay (ledger {doorbell.ledger})"
        self._outage = OutageReport(log, self.name)
        self._listen_outage = OutageReport(log, f"{self.name} LISTEN")

    # -- one tick ---------------------------------------------------------------------------
    def dispatch_room(self, *, fresh: bool = True) -> tuple[int, int | None]:
        """(doorbells the broker may take now, its dispatch depth or None if unknown).

        ``fresh``: read the depth now; otherwise a reading up to DEPTH_FRESH_S old will do.
        """
        now = time.monotonic()
        if fresh or now - self._depth_read > DEPTH_FRESH_S:
            self._depth, self._depth_read = self.doorbell.queued_dispatch(), now
            self._depth_seen = self._depth
        if self._depth is None:
            return BATCH, None
        metrics.record_dispatch_queue(self._depth, self.doorbell.ledger)
        return max(self.max_queued - self._depth, 0), self._depth

    def _published(self, messages: int) -> None:
        if self._depth is not None:
            self._depth += messages

    def _mark_due(self, status: Status, *, leased_ok: bool, limit: int = BATCH, queued: int | None = None) -> list[str]:
        """Up to ``limit`` due rows' ids (one statement; see the module docstring). ``queued``: None
        (the depth unknown), rows rung more than republish_after_s ago count as lost, and the rows
        returned are marked published; 0 (ringing by count), any row rung before counts and
        nothing is written."""
        # While listening, never-published rows get a grace: the NOTIFY path rings them.
        grace = self.listening and status is Status.NOT_DISPATCHED
        rows = mark_published_if_due(
            self.engine,
            status,
            leased_ok=leased_ok,
            batch=limit,
            republish_after_s=self.republish_after_s if queued is None else 0.0,
            fresh_grace_s=NOTIFIED_GRACE_S if grace else 0.0,
            leading_since=self.leading_since,
            write=queued is None,
        )
        if status is Status.NOT_DISPATCHED:
            # Relay lag: from the moment a row became due (commit, or retry time) to its doorbell.
            metrics.record_relay_lags(row[1] for row in rows)
        return [row[0] for row in rows]

    def _mark_rung(self) -> None:
        """published_at for the ids rung from NOTIFY that nobody has claimed yet (one statement),
        only while the broker's depth is unknown: with it, the ticks ring by count, not by mark."""
        with self._rung_lock:
            rung, self._rung = list(self._rung), set()
        if not rung or self._depth_seen is not None:
            return
        mark_published(self.engine, rung)

    def _ring_due(self) -> list[str]:
        """Ring for due rows: as many doorbells as the due rows need (one per doorbell_batch), less
        those the broker already holds, up to max_queued. Which rows: the oldest due, rung before or
        not (a doorbell's claim takes whatever is due; only the count of doorbells matters)."""
        room, queued = self.dispatch_room()
        if queued is None:  # depth unknown: ring what was never rung, or rung republish_after_s ago
            ids = self._mark_due(Status.NOT_DISPATCHED, leased_ok=True, queued=None)
        else:
            batch = self.doorbell.batch
            due = count_due(self.engine, cap=self.max_queued * batch)
            wanted = min(-(-due // batch), self.max_queued) - queued
            if wanted <= 0:
                return []
            ids = self._mark_due(Status.NOT_DISPATCHED, leased_ok=True, limit=min(wanted, room) * batch, queued=0)
        if ids:
            self._published(self.doorbell.ring_dispatch(ids))
        return ids

    def _ring_lookups(self) -> list[str]:
        """Ring the reconciler for due lookups as _ring_due rings dispatch: the doorbells the due
        lookups need, less those queued, up to max_queued; a reconcile doorbell's claim takes
        whatever lookups are due, so only the count matters."""
        queued = self.doorbell.queued_reconcile()
        ids: list[str] = []
        if queued is None:
            for status in sorted(RECONCILE_CLAIMABLE):
                ids += self._mark_due(status, leased_ok=False, queued=None)
        else:
            metrics.record_reconcile_queue(queued, self.doorbell.ledger)
            batch = self.doorbell.batch
            due = count_due(self.engine, cap=self.max_queued * batch, lookups=True)
            wanted = (min(-(-due // batch), self.max_queued) - queued) * batch
            for status in sorted(RECONCILE_CLAIMABLE):
                if len(ids) < wanted:
                    ids += self._mark_due(status, leased_ok=False, limit=wanted - len(ids), queued=0)
        if ids:
            self.doorbell.ring_reconcile(ids)
        return ids

    def ring_notified(self, operation_ids: list[str]) -> int:
        """Ring the doorbell for ids that submit notified (committed, due now), as many as the broker
        has room for. Returns messages sent; ids left out stay never-published (a tick rings them)."""
        room, _ = self.dispatch_room(fresh=False)
        fresh = list(dict.fromkeys(operation_ids))[: room * self.doorbell.batch]
        if not fresh:
            return 0
        sent = self.doorbell.ring_dispatch(fresh)
        self._published(sent)
        with self._rung_lock:
            self._rung.update(fresh)
        return sent

    def run_once(self) -> Tick:
        # Doorbells first: they are what a waiting agent's latency is made of; the sweep can wait.
        self._mark_rung()
        dispatch_ids = self._ring_due()
        expired = 0
        now = time.monotonic()
        if now - self._last_sweep >= self.sweep_every_s:
            self._last_sweep = now
            with self.sessions.begin() as session:
                expired = len(expire_leases(session))
            if expired:
                log.info("leases expired: %d operation(s) parked in outcome_unknown", expired)
            self._planner_stats.refresh_if_stale()
            settled = apply_unapplied(self.sessions, actor="sweep", sink=self._sink, packet=self._packet)
            if settled:
                log.info("late evidence: %d operation(s) settled by a success their worker did not apply", len(settled))
            self.doorbell.ring_rechecks(self.engine)
        # Runs whose current step settled: submit the next step, compensate, or end (run_advance.py).
        advance_due(self.sessions, irreversible=self._irreversible)
        reconcile_ids = self._ring_lookups()
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
        notified = publish.listener(self.engine)
        log.info("%s started (%s)", self.name, "LISTEN/NOTIFY + poll" if notified is not None else "polling")
        if notified is not None:
            self._listen_loop(notified)
        else:
            self._poll_loop()

    def stop(self) -> None:
        self.stop_event.set()

    def _safe_tick(self) -> Tick:
        try:
            tick = self.run_once()
        except OUTAGES as exc:  # the relay must outlive a database or broker outage: one WARNING
            self._outage.failed(exc, "%s tick failed; retrying", self.name)
        except Exception:  # noqa: BLE001 - nor may a bug stop it (it warns every time)
            log.warning("%s tick failed; retrying", self.name, exc_info=True)
        else:
            self._outage.succeeded()
            return tick
        self.stop_event.wait(min(self.poll_s * 4, 5.0))
        return Tick(0, 0, 0)

    def _poll_loop(self) -> None:
        while not self.stop_event.is_set():
            self.heartbeat.beat()
            tick = self._safe_tick()
            if not tick.busy:
                self.stop_event.wait(self.poll_s)

    def _listen_loop(self, notified: Any) -> None:
        # Ticks run in their own thread: a notification never waits for a tick's statements. The
        # first tick waits for the first LISTEN attempt, so it knows whether fresh rows are the
        # NOTIFY path's (a standby that ticked before listening rang the leader's ids again).
        ticker = threading.Thread(target=self._poll_loop, name="relay-ticks", daemon=True)
        try:
            while not self.stop_event.is_set():
                try:
                    with notified.connected() as conn:
                        self.listening = True
                        self._try_lead(conn)
                        if ticker.ident is None:  # not started yet
                            ticker.start()
                        self._listen(conn)
                except notified.errors as exc:
                    # One WARNING per outage (a ledger down for minutes is retried every second).
                    self._listen_outage.failed(exc, "%s lost its LISTEN connection; reconnecting", self.name)
                    if ticker.ident is None:
                        ticker.start()  # no LISTEN: the ticks are the relay (they retry the database)
                    self.stop_event.wait(1.0)
                finally:
                    self.leader = self.listening = False
                    self.leading_since = None
        finally:
            if ticker.ident is not None:
                ticker.join(timeout=10)

    def _listen(self, conn: Any) -> None:
        """Ring doorbells for notified ids (leader only), gathered into doorbells (gather.py); retry
        leading every poll_s."""
        last_try = time.monotonic()
        gather = Gather(
            batch=self.doorbell.batch,
            linger_s=self.linger_s,
            busy_linger_s=BUSY_LINGER_S,
            recheck_s=DEPTH_FRESH_S,
            busy=self._workers_busy,
        )
        while not self.stop_event.is_set():
            wait_s = gather.hold_s(time.monotonic()) if gather.pending else self.poll_s
            if select_mod.select([conn.fileno()], [], [], min(wait_s, STOP_CHECK_S))[0]:
                ids = conn.drain()  # every pending notification
                if self.leader:
                    gather.add(ids, time.monotonic())
            self._listen_outage.succeeded()  # listening: a LISTEN outage ends once quiet long enough
            now = time.monotonic()
            if gather.pending and gather.hold_s(now) <= 0:
                self._safe_ring(gather.take(now))
            if not self.leader and now - last_try >= self.poll_s:
                self._try_lead(conn)
                last_try = time.monotonic()

    def _workers_busy(self) -> bool:
        """A dispatch doorbell of this ledger waited in the broker at the last reading (DEPTH_FRESH_S
        at most ago). The reading itself, not our publishes counted since: a doorbell we just rang
        may already be a worker's. False if the depth cannot be read (queued_dispatch: None)."""
        self.dispatch_room(fresh=False)
        return bool(self._depth_seen)

    def _try_lead(self, conn: Any) -> None:
        # A lock held while the listening connection lives: when it ends, a standby takes over.
        self.leading_since = conn.try_lead()
        self.leader = self.leading_since is not None
        if self.leader:
            log.info("%s rings doorbells from NOTIFY (leader)", self.name)

    def _safe_ring(self, ids: list[str]) -> None:
        # Either way the next tick rings them (published_at is still empty).
        try:
            self.ring_notified(ids)
        except OUTAGES as exc:
            self._outage.failed(
                exc, "%s could not publish %d notified doorbell(s); the next tick retries", self.name, len(ids)
            )
        except Exception:  # noqa: BLE001
            log.warning(
                "relay could not publish %d notified doorbell(s); the next tick retries", len(ids), exc_info=True
            )
