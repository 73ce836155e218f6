"""Test harness for the pipeline: real Celery worker processes, the relay, the sandbox provider.

Workers run as separate OS processes (``celery -A workers worker -P solo``: one process that
does the work itself, so SIGKILL / SIGSTOP hit exactly the process holding the lease). The relay
runs in a thread of the test process. Every test run uses its own Redis key prefix and database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.models import Attempt, Operation
from outbox.settings import Settings
from outbox.submit import Receipt, submit

ROOT = Path(__file__).resolve().parent.parent


def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.05, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def action(path: str, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "target": "sandbox",
        "request": {"method": "POST", "path": path},
        "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
        "fencing_header": "X-Fencing-Token",
        "lookup": {
            "request": {"method": "GET", "path": path, "query": {"idempotency_key": "{idempotency_key}"}},
            "authoritative_not_found": True,
            "settle_s": 0.5,
            "succeeded": ["succeeded", "open", "sent"],
            "pending": ["pending"],
            "failed": ["failed"],
        },
        "result_reference": "id",
        "budget": {"max_attempts": 4, "deadline_s": 120, "base_delay_s": 0.1, "max_delay_s": 1},
    }
    doc.update(over)
    return doc


def actions_doc(
    base_url: str,
    *,
    timeout_s: float = 1.0,
    breaker: dict[str, Any] | None = None,
    actions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "targets": {
            "sandbox": {
                "base_url": base_url,
                "timeout_s": timeout_s,
                "connect_timeout_s": 0.5,
                "breaker": breaker or {"fail_max": 1000, "reset_timeout_s": 5},
            }
        },
        "actions": actions
        or {
            "payments.refund.create": action("/v1/refunds", decimal_args=["amount"]),
            "support.ticket.create": action("/v1/tickets"),
        },
    }


REFUND_ARGS = {"order_id": "o-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Pipeline:
    """One test's pipeline: env for workers, the relay thread, and helpers to look at the ledger."""

    env: dict[str, str]
    sessions: sessionmaker[Session]
    tmp: Path
    workers: list[WorkerProc] = field(default_factory=list)
    _relay: Any = None
    _relay_thread: threading.Thread | None = None

    def settings(self) -> Settings:
        return Settings(
            **{
                k[len("OUTBOX_") :].lower(): v
                for k, v in self.env.items()
                if k.startswith("OUTBOX_") and k not in ("OUTBOX_FAILPOINTS",)
            }
        )

    def write_actions(self, doc: dict[str, Any]) -> None:
        path = self.tmp / "actions.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.env["OUTBOX_ACTIONS_FILE"] = str(path)

    def start_worker(
        self,
        name: str | None = None,
        *,
        queues: str = "dispatch,outcome_unknown",
        extra_env: dict[str, str] | None = None,
        ready_timeout_s: float = 30.0,
    ) -> WorkerProc:
        name = name or f"w{len(self.workers) + 1}"
        log_path = self.tmp / f"{name}.log"
        env = dict(os.environ) | self.env | (extra_env or {})
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "workers",
            "worker",
            "-P",
            "solo",
            "-Q",
            queues,
            "-n",
            f"{name}-{uuid.uuid4().hex[:6]}@%h",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
        ]
        out = open(log_path, "wb")
        proc = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
        worker = WorkerProc(name, proc, log_path)
        self.workers.append(worker)
        wait_for(
            lambda: " ready." in worker.log() or proc.poll() is not None, ready_timeout_s, what=f"worker {name} ready"
        )
        if proc.poll() is not None:
            raise AssertionError(f"worker {name} exited: {worker.log()[-3000:]}")
        return worker

    def start_relay(self, *, poll_s: float = 0.1, republish_after_s: float = 2.0, evidence_sink: Any = None) -> Any:
        """evidence_sink: an outbox.evidence.EvidenceSink on a separate database, so the relay
        backfills committed_evidence_degraded operations (as the real relay does when
        OUTBOX_EVIDENCE_URL is set)."""
        from workers.celery_app import make_app
        from workers.doorbell import Doorbell
        from workers.relay import Relay

        app = make_app(self.settings())
        self._relay = Relay(
            self.sessions.kw["bind"],
            Doorbell(app, batch=self.settings().doorbell_batch),
            poll_s=poll_s,
            republish_after_s=republish_after_s,
            sweep_every_s=0.2,
            evidence_sink=evidence_sink,
        )
        self._relay_thread = threading.Thread(target=self._relay.run_forever, daemon=True)
        self._relay_thread.start()
        return self._relay

    def stop(self) -> None:
        if self._relay is not None:
            self._relay.stop()
            if self._relay_thread is not None:
                self._relay_thread.join(10)
        for w in self.workers:
            w.stop()

    # -- the ledger, as a test sees it ----------------------------------------------------
    def submit(
        self,
        key: str,
        args: dict[str, Any] | None = None,
        *,
        action: str = "payments.refund.create",
        tenant: str = "t1",
        **kw: Any,
    ) -> Receipt:
        with self.sessions.begin() as s:
            return submit(
                s,
                tenant=tenant,
                idempotency_key=key,
                action=action,
                args=args or dict(REFUND_ARGS),
                subject="test",
                **kw,
            )

    def op(self, operation_id: str) -> Operation:
        with self.sessions() as s:
            op = s.get(Operation, operation_id)
            assert op is not None
            return op

    def attempts(self, operation_id: str, kind: str | None = None) -> list[Attempt]:
        with self.sessions() as s:
            stmt = select(Attempt).where(Attempt.operation_id == operation_id)
            if kind:
                stmt = stmt.where(Attempt.kind == kind)
            return list(s.execute(stmt.order_by(Attempt.id)).scalars())

    def wait_status(self, operation_id: str, *statuses: str, timeout_s: float = 20.0) -> Operation:
        return wait_for(
            lambda: (op := self.op(operation_id)).status in statuses and op,
            timeout_s,
            what=f"{operation_id} in {statuses} (now {self.op(operation_id).status})",
        )

    def count(self, status: str | None = None) -> int:
        with self.sessions() as s:
            stmt = select(func.count()).select_from(Operation)
            if status:
                stmt = stmt.where(Operation.status == status)
            return int(s.execute(stmt).scalar_one())


@contextmanager
def pipeline(
    *,
    db_url: str,
    sessions: sessionmaker[Session],
    redis_url: str,
    tmp: Path,
    sandbox_url: str,
    env: dict[str, str] | None = None,
) -> Iterator[Pipeline]:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    base = {
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_BROKER_URL": redis_url,
        "OUTBOX_REDIS_URL": redis_url,
        "OUTBOX_BROKER_KEY_PREFIX": prefix,
        "OUTBOX_DATA_DIR": str(tmp / "data"),
        # Short lease so lease-expiry tests run in seconds: soft < hard < lease < visibility.
        "OUTBOX_SOFT_TIME_LIMIT_S": "2",
        "OUTBOX_TIME_LIMIT_S": "2.5",
        "OUTBOX_LEASE_S": "3",
        "OUTBOX_VISIBILITY_TIMEOUT_S": "3600",
    }
    p = Pipeline(env=base | (env or {}), sessions=sessions, tmp=tmp)
    p.write_actions(actions_doc(sandbox_url))
    try:
        yield p
    finally:
        p.stop()
        _clear_prefix(redis_url, prefix)


def _clear_prefix(redis_url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}*", count=500)) + list(
        r.scan_iter(match=f"agent-outbox:breaker:{prefix}*", count=500)
    )
    if keys:
        r.delete(*keys)


class PrivateRedis:
    """A redis-server of the test's own (no persistence) on a free port: safe to SIGKILL and restart.

    The shared Redis on 6379 serves other runs; broker-restart tests point OUTBOX_BROKER_URL here.
    """

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        from sandbox.testing import free_port

        self.tmp = tmp
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        import redis

        log = open(self.tmp / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                str(self.tmp),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def up() -> bool:
            try:
                return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping())
            except redis.RedisError:
                return False

        wait_for(up, 10, what=f"private redis on {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL: queued messages are gone (no AOF, no RDB)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)
