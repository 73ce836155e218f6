"""Per-process resources of a worker: ledger engine, actions, connectors, breakers, doorbell.

Built lazily in each process (Celery's prefork children must not share a parent's connections),
and rebuilt when the process id changes.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from breaker import BreakerConfig, BreakerRegistry
from downstream.actions import ActionsConfig, load_actions
from downstream.connectors import ConnectorSet
from outbox.db import make_engine, make_sessionmaker
from outbox.errors import ConfigError
from outbox.evidence import EvidenceSink
from outbox.ledger_connection import LedgerConnection
from outbox.settings import Settings, load_settings
from workers.celery_app import check_time_limits, make_app
from workers.doorbell import Doorbell
from workers.fan_out import Caller
from workers.finalize import Recorder


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    actions: ActionsConfig
    connectors: ConnectorSet
    breakers: BreakerRegistry
    doorbell: Doorbell
    worker_id: str
    evidence: EvidenceSink
    # The hot path's own connection (claims, finalizes); everything else uses sessions.
    ledger: LedgerConnection
    # A doorbell batch's calls to a slow target run concurrently, one thread each (httpx transports
    # are thread-safe); calls to a target faster than fan_out.FAST_CALL_S run in turn.
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(thread_name_prefix="dispatch"))

    def caller(self) -> Caller:
        """What fan-out takes to call the downstream."""
        return Caller(self.actions, self.connectors, self.breakers, self.pool)

    def recorder(self) -> Recorder:
        """What finalize takes to record outcomes and ring what follows."""
        return Recorder(self.ledger, self.sessions, self.evidence, self.doorbell, self.worker_id, self.actions)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.evidence.close()
        self.ledger.close()
        self.connectors.close()
        self.breakers.close()
        self.engine.dispose()


def load_actions_for(settings: Settings) -> ActionsConfig:
    if settings.actions_file is None:
        raise ConfigError(
            "OUTBOX_ACTIONS_FILE is not set: workers need the actions/targets file (see examples/actions.yaml)"
        )
    return load_actions(settings.actions_file)


def breaker_registry(settings: Settings, actions: ActionsConfig) -> BreakerRegistry:
    configs = {
        name: BreakerConfig(
            fail_max=t.breaker.fail_max,
            reset_timeout_s=t.breaker.reset_timeout_s,
            success_threshold=t.breaker.success_threshold,
        )
        for name, t in actions.targets.items()
    }
    # The broker key prefix doubles as the breaker namespace: one Redis, several deployments.
    return BreakerRegistry(
        configs, redis_url=settings.redis_url or None, namespace=settings.broker_key_prefix or "default"
    )


def build_runtime(settings: Settings | None = None, *, app: Celery | None = None) -> Runtime:
    """Everything a worker's tasks use. ``app``: the Celery app doorbells are published with (a
    worker passes its own; otherwise one is made from the settings)."""
    settings = settings or load_settings()
    actions = load_actions_for(settings)
    longest = max((t.timeout_s + t.connect_timeout_s for t in actions.targets.values()), default=0.0)
    check_time_limits(settings, longest_call_s=longest)
    # No pre-ping: it costs a round trip per transaction (12% of a dispatch, bench/README.md);
    # a connection lost anyway invalidates the pool and the doorbell is re-published.
    engine = make_engine(settings.resolved_database_url, pool_pre_ping=False)
    sessions = make_sessionmaker(engine)
    return Runtime(
        settings=settings,
        engine=engine,
        sessions=sessions,
        actions=actions,
        connectors=ConnectorSet(actions),
        breakers=breaker_registry(settings, actions),
        doorbell=Doorbell(app or make_app(settings), batch=settings.doorbell_batch),
        # Unique per process start: a restarted container reuses its host name and often its pid,
        # and must not pass for its predecessor in lease_owner and the history (the fencing token
        # is what guards writes; this is what people read). host:start:pid.
        worker_id=f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}:{os.getpid()}",
        evidence=EvidenceSink.from_url(settings.evidence_url),
        ledger=LedgerConnection(engine, sessions),
        pool=ThreadPoolExecutor(max_workers=settings.doorbell_batch, thread_name_prefix="dispatch"),
    )


_lock = threading.Lock()
_runtime: Runtime | None = None
_pid: int | None = None


def get_runtime(app: Celery | None = None) -> Runtime:
    """This process's runtime, built on first use (again after a fork)."""
    global _runtime, _pid
    with _lock:
        if _runtime is None or _pid != os.getpid():
            _runtime, _pid = build_runtime(app=app), os.getpid()
        return _runtime


def reset_runtime() -> None:
    global _runtime, _pid
    with _lock:
        if _runtime is not None and _pid == os.getpid():
            _runtime.close()
        _runtime, _pid = None, None
