"""The process wiring of a worker: its resources (ledger engine, actions, connectors, breakers,
doorbell), and the dispatcher and reconciler made of them, each given only what it uses.

Built lazily in each process (Celery's prefork children must not share a parent's connections),
and rebuilt when the process id changes.

A fleet draining several ledgers (OUTBOX_DATABASE_URLS) has one Runtime per ledger, built on the
first doorbell that names it (``Fleet``): each its own engine, doorbell (its queues), calls and
lookups in flight (room, threads, finalizer), so a ledger that is down holds only its own calls and
finalize retries. What is the process's, not a ledger's, is shared by all of them: the actions, the
connectors (HTTP pools), the breakers and the pacer (a provider's limits are the whole process's),
the evidence sink and the worker id.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from breaker import BreakerRegistry
from outbox.errors import ConfigError
from outbox.evidence.checks import RecheckTerms
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.authority import board_for
from outbox.ledger.db import FLEET_CONNECT_TIMEOUT_S, connect_timeout_args, make_engine, make_sessionmaker
from outbox.ledger.fairness import Fairness
from outbox.ledger.hot_path import LedgerConnection
from outbox.settings import Settings, load_settings
from workers.dispatch.batch import Dispatcher
from workers.dispatch.gate import Gate
from workers.dispatch.in_flight import InFlight
from workers.engine.authority import Authority
from workers.engine.committer import Committer
from workers.engine.doorbell import Doorbell
from workers.engine.downstream import Downstream
from workers.ground import metrics
from workers.pacing import Pacer
from workers.provider.actions import ActionsFile
from workers.provider.connectors import ConnectorSet
from workers.reconcile.batch import Reconciler
from workers.reconcile.in_flight import LookupsInFlight
from workers.reconcile.lookup import LookupBudget
from workers.wiring.builders import breaker_registry, load_actions_for, longest_call_s, pacer_for, start_up_problems
from workers.wiring.celery_app import make_app


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    actions: ActionsFile
    connectors: ConnectorSet
    breakers: BreakerRegistry
    pacer: Pacer
    doorbell: Doorbell
    worker_id: str
    evidence: EvidenceSink
    # The doorbell task's own connection (gate reads, claims); finalize has another (in_flight);
    # everything else uses sessions.
    ledger: LedgerConnection
    # The ledger's name in a fleet (OUTBOX_DATABASE_URLS); None: the one ledger.
    ledger_name: str | None = None
    # Whether close() also closes what a fleet's runtimes share (connectors, breakers, pacer,
    # evidence): a Runtime built alone owns them; a Fleet closes them once, after every ledger's.
    owns_shared: bool = True
    _in_flight: InFlight | None = field(default=None, init=False, repr=False)
    _in_flight_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _lookups: LookupsInFlight | None = field(default=None, init=False, repr=False)
    _dispatcher: Dispatcher | None = field(default=None, init=False, repr=False)
    _reconciler: Reconciler | None = field(default=None, init=False, repr=False)

    def downstream(self) -> Downstream:
        """What fan-out and lookups take to call a provider."""
        return Downstream(self.actions, self.connectors, self.pacer, authority=self.authority, sessions=self.sessions)

    @property
    def authority(self) -> Authority:
        """Who may still act on this ledger, as this process last read it (one board per ledger)."""
        return Authority(self.sessions, board_for(self.engine))

    def committer(self, ledger: LedgerConnection) -> Committer:
        """What finalize takes to record outcomes (on ``ledger``) and ring what follows."""
        return Committer(ledger, self.sessions, self.evidence, self.doorbell, self.worker_id, self.actions)

    @property
    def in_flight(self) -> InFlight:
        """This process's calls in flight (threads started on first use; finalize has its own
        connection: the claim's belongs to the doorbell task's thread)."""
        with self._in_flight_lock:
            if self._in_flight is None:
                self._in_flight = InFlight(
                    self.downstream(),
                    self.committer(LedgerConnection(self.engine, self.sessions)),
                    max_ops=self.settings.max_in_flight,
                    lease_s=self.settings.lease_s,
                    ledger=self.ledger_name,
                )
            return self._in_flight

    @property
    def lookups(self) -> LookupsInFlight:
        """This process's lookups in flight (the reconciler's; threads started on first use). Settling
        uses only sessions, so the committer shares the doorbell task's (idle) hot-path connection."""
        with self._in_flight_lock:
            if self._lookups is None:
                rechecks = RecheckTerms(
                    self.settings.handoff_recheck_first_s,
                    self.settings.handoff_recheck_max_s,
                    self.settings.handoff_recheck_without_keys_s,
                )
                budget = LookupBudget(
                    self.settings.reconcile_max_lookups, self.settings.reconcile_max_delay_s, rechecks
                )
                self._lookups = LookupsInFlight(
                    self.downstream(),
                    self.committer(self.ledger),
                    budget,
                    max_ops=self.settings.max_in_flight,
                    ledger=self.ledger_name,
                )
            return self._lookups

    @property
    def dispatcher(self) -> Dispatcher:
        """What a dispatch doorbell takes: the gate (on the doorbell task's connection), the calls
        in flight, and the claim's terms."""
        if self._dispatcher is None:
            gate = Gate(
                self.ledger,
                self.sessions,
                self.actions,
                self.breakers,
                self.worker_id,
                evidence=self.evidence,
                evidence_required=self.settings.evidence_required,
                authority=self.authority,
            )
            self._dispatcher = Dispatcher(
                gate,
                self.in_flight,
                lease_s=self.settings.lease_s,
                batch=self.settings.doorbell_batch,
                room_wait_s=self.room_wait_s,
                fairness=Fairness(self.settings.fairness, self.settings.tenant_weight_map),
            )
        return self._dispatcher

    @property
    def reconciler(self) -> Reconciler:
        """What a reconcile doorbell takes: the committer its lookups settle with, the breakers, the
        lookups in flight, and the claim's terms."""
        if self._reconciler is None:
            lookups = self.lookups
            self._reconciler = Reconciler(
                lookups.committer, self.breakers, lookups, lease_s=self.settings.lease_s, room_wait_s=self.room_wait_s
            )
        return self._reconciler

    @property
    def room_wait_s(self) -> float:
        # A doorbell waits for room at most half its task's soft time limit, then leaves the work
        # to the relay's next doorbell.
        return self.settings.soft_time_limit_s / 2

    def close(self) -> None:
        if self._in_flight is not None:
            # Calls already out are finalized if they answer in time; otherwise their leases bring
            # them back (outcome_unknown, then the reconciler).
            self._in_flight.close(timeout_s=longest_call_s(self.actions) + 2.0)
        if self._lookups is not None:
            # Lookups out are settled if they answer in time; otherwise their leases expire and
            # they are claimed again.
            self._lookups.close(timeout_s=longest_call_s(self.actions) + 2.0)
        self.ledger.close()
        self.engine.dispose()
        if self.owns_shared:
            close_shared(self.evidence, self.connectors, self.breakers, self.pacer)


def close_shared(evidence: EvidenceSink, connectors: ConnectorSet, breakers: BreakerRegistry, pacer: Pacer) -> None:
    evidence.close()
    connectors.close()
    breakers.close()
    pacer.close()


def build_runtime(settings: Settings | None = None, *, app: Celery | None = None) -> Runtime:
    """Everything a worker's tasks use, on the one ledger (OUTBOX_DATABASE_URL). ``app``: the Celery
    app doorbells are published with (a worker passes its own; otherwise one is made from the
    settings)."""
    rt = Fleet(settings or load_settings(), app=app, single=True).runtime(None)
    rt.owns_shared = True  # nothing else holds its fleet: its close() closes what the fleet shares
    return rt


class UnknownLedger(ConfigError):
    """A doorbell named a ledger this process's OUTBOX_DATABASE_URLS does not."""


class Fleet:
    """The runtimes of this process, one per ledger it drains, built on first use; what they share
    is built once (module docstring). ``single``: the one ledger of OUTBOX_DATABASE_URL, whatever
    OUTBOX_DATABASE_URLS says (build_runtime)."""

    def __init__(self, settings: Settings, *, app: Celery | None = None, single: bool = False) -> None:
        self.settings = settings
        self.urls: dict[str | None, str] = {None: settings.resolved_database_url} if single else settings.ledger_urls
        self.actions = load_actions_for(settings)
        problems = start_up_problems(settings, self.actions)
        if problems:
            raise ConfigError("; ".join(problems))
        self.app = app or make_app(settings)
        # Unique per process start: a restarted container reuses its host name and often its pid,
        # and must not pass for its predecessor in lease_owner and the history (the fencing token
        # is what guards writes; this is what people read). host:start:pid.
        self.worker_id = f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}:{os.getpid()}"
        self.connectors = ConnectorSet(self.actions)
        self.breakers = breaker_registry(settings, self.actions)
        self.pacer = pacer_for(settings, self.actions, self.worker_id)
        self.evidence = EvidenceSink.from_url(settings.evidence_url)
        metrics.watch_evidence_sink(self.evidence)
        self._runtimes: dict[str | None, Runtime] = {}
        self._lock = threading.Lock()
        # A doorbell that names no ledger (rung before the fleet was told of several, or by a
        # process without OUTBOX_DATABASE_URLS) is OUTBOX_DATABASE_URL's, if the fleet drains it.
        self._unnamed = next((n for n, u in self.urls.items() if u == settings.resolved_database_url), None)

    @property
    def names(self) -> list[str | None]:
        return list(self.urls)

    def runtime(self, name: str | None) -> Runtime:
        """The runtime of ledger ``name`` (None: the one ledger). UnknownLedger if this process
        does not drain it."""
        if name is None and None not in self.urls and self._unnamed is not None:
            name = self._unnamed
        with self._lock:
            rt = self._runtimes.get(name)
            if rt is not None:
                return rt
            if name not in self.urls:
                named = f"names ledger {name!r}" if name is not None else "names no ledger"
                drains = ", ".join(str(n) for n in self.urls) if None not in self.urls else "its one ledger"
                raise UnknownLedger(
                    f"a doorbell {named}, and this worker drains {drains}: give every worker and relay "
                    "of the fleet the same OUTBOX_DATABASE_URLS"
                )
            # No pre-ping: it costs a round trip per transaction, a sizeable share of a dispatch
            # ; a connection lost anyway invalidates the pool and the doorbell is
            # re-published.
            # A fleet's ledger that stops answering (a host gone, not a refused connection) must not
            # hold a doorbell task for the operating system's TCP timeout (~2 min), others behind it.
            timeout = connect_timeout_args(self.urls[name], FLEET_CONNECT_TIMEOUT_S) if name is not None else {}
            engine = make_engine(self.urls[name], pool_pre_ping=False, **timeout)
            sessions = make_sessionmaker(engine)
            rt = self._runtimes[name] = Runtime(
                settings=self.settings,
                engine=engine,
                sessions=sessions,
                actions=self.actions,
                connectors=self.connectors,
                breakers=self.breakers,
                pacer=self.pacer,
                doorbell=Doorbell(self.app, batch=self.settings.doorbell_batch, ledger=name),
                worker_id=self.worker_id,
                evidence=self.evidence,
                ledger=LedgerConnection(engine, sessions),
                ledger_name=name,
                owns_shared=False,
            )
            return rt

    def built(self) -> list[Runtime]:
        with self._lock:
            return list(self._runtimes.values())

    def close(self) -> None:
        for rt in self.built():
            rt.close()
        close_shared(self.evidence, self.connectors, self.breakers, self.pacer)


_lock = threading.Lock()
_fleet: Fleet | None = None
_pid: int | None = None


def get_fleet(app: Celery | None = None) -> Fleet:
    """This process's runtimes, made on first use (again after a fork)."""
    global _fleet, _pid
    with _lock:
        if _fleet is None or _pid != os.getpid():
            _fleet, _pid = Fleet(load_settings(), app=app), os.getpid()
        return _fleet


def get_runtime(app: Celery | None = None, ledger: str | None = None) -> Runtime:
    """This process's runtime of ``ledger`` (None: the one ledger), built on first use."""
    return get_fleet(app).runtime(ledger)


def reset_runtime() -> None:
    global _fleet, _pid
    with _lock:
        if _fleet is not None and _pid == os.getpid():
            _fleet.close()
        _fleet, _pid = None, None
