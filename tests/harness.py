"""Test harness for the pipeline: real Celery worker processes, the relay, the sandbox provider.

Workers run as separate OS processes (``celery -A workers worker -P solo``: one process that
does the work itself, so SIGKILL / SIGSTOP hit exactly the process holding the lease). The relay
runs in a thread of the test process. Every test run uses its own Redis key prefix and database.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.models import Attempt, Operation
from outbox.ledger.submit import Receipt
from outbox.settings import Settings
from producer import submit
from tests import spawn

# The tests import the sandbox's actions document from here (one copy, shared with the demo).
from workers.sandbox.scenario import action as action
from workers.sandbox.scenario import actions_doc

ROOT = Path(__file__).resolve().parent.parent


# Every (from, to) status pair the suite's operations moved through, read from their history before
# each ledger is emptied or dropped (tests/conftest.py checks them against states.ALLOWED at the end
# of the run). Here, not in conftest: pytest loads conftest as a module of its own ("conftest"), apart
# from the "tests.conftest" that test files import, and every ledger must add to one set.
MOVES_TAKEN: set[tuple[str, str]] = set()


def record_moves(engine: Any) -> None:
    from sqlalchemy import text

    from outbox.ledger.models import HISTORY

    with engine.connect() as conn:
        rows = conn.execute(
            # A "cancel requested" row records a request, not a move (its status stays as it was).
            text(
                f"SELECT DISTINCT from_status, to_status FROM {HISTORY}"
                " WHERE from_status IS NOT NULL AND event <> 'cancel requested'"
            )
        ).all()
    MOVES_TAKEN.update((r[0], r[1]) for r in rows)


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float = 20.0,
    interval_s: float = 0.05,
    what: str | Callable[[], str] = "condition",
) -> Any:
    """``what``: said on timeout; a callable is asked then (the state at the moment it failed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)


# Every time a shared breaker stores moves back by ARGV[1] ms (integers: HINCRBY), and the half-open
# probe lock's time to live shrinks by as much (gone if that was all it had left).
_ADVANCE_BREAKER = """
local ms = tonumber(ARGV[1])
for _, name in ipairs({'opened_at_ms', 'reopens_at_ms', 'reset_at_ms'}) do
  if redis.call('HEXISTS', KEYS[1], name) == 1 then redis.call('HINCRBY', KEYS[1], name, -ms) end
end
local ttl = redis.call('PTTL', KEYS[2])
if ttl > 0 then
  if ttl <= ms then redis.call('DEL', KEYS[2]) else redis.call('PEXPIRE', KEYS[2], ttl - ms) end
end
return 1
"""


def fullest_window(times: Collection[float], window_s: float, *, after_s: float = 0.0) -> list[float]:
    """The events (e.g. the sandbox's request arrival times) of the fullest ``window_s`` window, counting
    only those ``after_s`` or more after the first event."""
    ordered = sorted(times)
    ordered = [t for t in ordered if t >= ordered[0] + after_s] if ordered else []
    best: list[float] = []
    lo = 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] >= window_s:
            lo += 1
        if hi - lo + 1 > len(best):
            best = ordered[lo : hi + 1]
    return best


def max_in_any_window(times: Collection[float], window_s: float, *, after_s: float = 0.0) -> int:
    """How many events the fullest ``window_s`` window holds (fullest_window)."""
    return len(fullest_window(times, window_s, after_s=after_s))


# A log record's first line: a Celery worker's ("[date: LEVEL/process] ...") or the CLI's ("date time,ms LEVEL ...").
_RECORD = re.compile(r"^\[[^\]]*: (?P<w>[A-Z]+)/[^\]]*\]|^\d{4}-\d\d-\d\d [\d:,]+ (?P<c>[A-Z]+) ")


def log_records(log: str, *levels: str) -> list[str]:
    """The first lines of a log's records at ``levels`` (ERROR, CRITICAL, ...)."""
    return [
        line for line in log.splitlines() if (m := _RECORD.match(line)) and (m.group("w") or m.group("c")) in levels
    ]


def whole_log_records(log: str, *levels: str, lines: int = 40) -> str:
    """Those records with the lines that follow each (its traceback), for a failure's message: the
    first line alone did not say where stop 43's stale soft limit had landed."""
    out: list[str] = []
    taking = 0
    for line in log.splitlines():
        if m := _RECORD.match(line):
            taking = lines if (m.group("w") or m.group("c")) in levels else 0
        if taking:
            out.append(line)
            taking -= 1
    return "\n".join(out)


# What an outage of PostgreSQL or Redis raises, as a traceback's last line names it: a loop's first
# failure of an outage is a WARNING with its traceback (workers/ground/outage.py, OutageReport); any
# other exception, or one raised while handling the outage's (a session not rolled back:
# PendingRollbackError), is a bug.
_OUTAGE = re.compile(
    r"^([\w.]+\.)?(OperationalError|InterfaceError|ConnectionError|ConnectionRefusedError|ConnectionResetError"
    r"|BrokenPipeError)(:|$)"
)


def _raised(lines: list[str], start: int) -> str:
    """The exception line ending the traceback that starts at ``lines[start]``."""
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith((" ", "\t")):
            return line
    return ""


def error_lines(log: str, *, outages: bool = False) -> list[str]:
    """A worker log's ERROR lines and tracebacks: ERROR is for final failures, an outage is a WARNING.

    ``outages``: for a test that cuts PostgreSQL or Redis, a traceback inside a WARNING record whose
    exception is that outage's connection error is what OutageReport says once per outage, not an
    error. Each traceback of a chain is judged by its own last line; one printed bare after such a
    record ("Exception in thread ...") always counts.
    """
    lines = log.splitlines()
    found: list[str] = []
    level = ""
    for i, line in enumerate(lines):
        if m := _RECORD.match(line):
            level = m.group("w") or m.group("c")
        if "ERROR/" in line or "/ERROR" in line:
            found.append(line)
        elif "Traceback" in line:
            bare = i > 0 and lines[i - 1].startswith(("Exception in thread", "Exception ignored"))
            if not (outages and level == "WARNING" and not bare and _OUTAGE.match(_raised(lines, i))):
                found.append(line)
    return found


def pk(key: str, tenant: str = "t1") -> str:
    """The key the provider sees for ``key`` of ``tenant`` (the default provider_key template);
    Pipeline.submit's tenant is t1."""
    return f"{tenant}:{key}"


def advance_breaker_clock(redis_url: str, namespace: str, target: str, seconds: float) -> None:
    """Move a shared (Redis) breaker's clock ``seconds`` forward without waiting.

    The breaker reads Redis server time (``TIME``), which a test cannot move; moving the times it
    stored back instead (opened_at, reopens_at, the probe lock's expiry) is the same, for every
    decision it takes, as that much time passing: an open breaker's reset window runs out. Process-
    local breakers (the fallback while Redis is unreachable) keep their own monotonic clocks.
    """
    import redis

    from breaker.storage import RedisBreakerStorage

    if seconds < 0:
        raise ValueError("the clock only moves forward")
    client = redis.Redis.from_url(redis_url)
    try:
        keys = RedisBreakerStorage(client, namespace, target)
        client.eval(_ADVANCE_BREAKER, 2, keys.state_key, keys.probe_key, round(seconds * 1000))
    finally:
        client.close()


def descendants(pid: int) -> list[int]:
    """Child processes of ``pid`` and theirs (from /proc; empty where there is no /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(parents.get(child, []))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# For tests that move the ledger's clock (Pipeline.advance_ledger_clock) to run leases out: a
# lease that never runs out by itself while a test lasts, so only the move can have expired it.
CLOCK_LEASE = {"OUTBOX_LEASE_S": "60"}
# A reconciler that looks operations up within a second and is not short of lookups.
FAST_LOOKUPS = {"OUTBOX_RECONCILE_MAX_DELAY_S": "1", "OUTBOX_RECONCILE_MAX_LOOKUPS": "200"}

REFUND_ARGS = {"order_id": "o-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes] | spawn.Forked
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes (prefork), children first."""
        if self.proc.poll() is None:
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                _signal(pid, signal.SIGKILL)
            self.proc.wait(10)

    def freeze(self) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            _signal(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            _signal(pid, signal.SIGCONT)

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
        pool: str = "solo",
        concurrency: int = 1,
        loglevel: str = "INFO",
    ) -> WorkerProc:
        """A Celery worker process (``pool``: solo, or prefork with ``concurrency`` children)."""
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
            pool,
            *(["-c", str(concurrency)] if pool != "solo" else []),
            "-Q",
            queues,
            "-n",
            f"{name}-{uuid.uuid4().hex[:6]}@%h",
            "--loglevel",
            loglevel,
            "--without-gossip",
            "--without-mingle",
        ]
        out = open(log_path, "wb")
        proc = spawn.popen(cmd, cwd=self.tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
        worker = WorkerProc(name, proc, log_path)
        self.workers.append(worker)
        wait_for(
            lambda: " ready." in worker.log() or proc.poll() is not None, ready_timeout_s, what=f"worker {name} ready"
        )
        if proc.poll() is not None:
            raise AssertionError(f"worker {name} exited: {worker.log()[-3000:]}")
        return worker

    def start_relay(
        self, *, poll_s: float = 0.1, republish_after_s: float = 2.0, evidence_sink: Any = None, thread: bool = True
    ) -> Any:
        """evidence_sink: an outbox.evidence.sinks.EvidenceSink on a separate database, so the relay
        backfills committed_evidence_degraded operations (as the real relay does when
        OUTBOX_EVIDENCE_URL is set). ``thread=False``: the relay is made, not started; the test
        runs each of its ticks (``run_once()``), so nothing is rung or advanced behind its back."""
        from workers.engine.doorbell import Doorbell
        from workers.relay.loop import Relay
        from workers.wiring.celery_app import make_app

        app = make_app(self.settings())
        self._relay = Relay(
            self.sessions.kw["bind"],
            Doorbell(app, batch=self.settings().doorbell_batch),
            poll_s=poll_s,
            republish_after_s=republish_after_s,
            sweep_every_s=0.2,
            evidence_sink=evidence_sink,
            max_queued=self.settings().relay_max_queued,
        )
        if not thread:
            return self._relay
        self._relay_thread = threading.Thread(target=self._relay.run_forever, daemon=True)
        self._relay_thread.start()
        return self._relay

    def start_fleet_relay(self) -> Any:
        """The relays of every ledger OUTBOX_DATABASE_URLS names (workers/relay/fleet.py), as
        ``agent-outbox relay`` runs them, in a thread."""
        from workers.cli.pipeline import build_relay

        self._relay = build_relay(self.settings())
        self._relay_thread = threading.Thread(target=self._relay.run_forever, daemon=True)
        self._relay_thread.start()
        return self._relay

    def on_ledger(self, sessions: sessionmaker[Session]) -> Pipeline:
        """The same pipeline as seen from another ledger of its fleet (submit, op, count there)."""
        return Pipeline(env=self.env, sessions=sessions, tmp=self.tmp)

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
        subject: str = "test",
        **kw: Any,
    ) -> Receipt:
        with self.sessions.begin() as s:
            return submit(
                s,
                tenant=tenant,
                idempotency_key=key,
                action=action,
                args=args or dict(REFUND_ARGS),
                subject=subject,
                **kw,
            )

    def statuses(self, operation_ids: Collection[str]) -> dict[str, str] | None:
        """Every operation's status, in one query; None while the ledger does not answer (a fault
        test's restart)."""
        import sqlalchemy.exc

        try:
            with self.sessions() as s:
                rows = s.execute(select(Operation.id, Operation.status).where(Operation.id.in_(operation_ids))).all()
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError):
            return None
        return {str(op_id): str(status) for op_id, status in rows}

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
            # Asked at the timeout (a string would say the status the wait began with).
            what=lambda: f"{operation_id} in {statuses} ({self.story(operation_id)})",
        )

    def story(self, operation_id: str) -> str:
        """Where the operation is now and what each of its attempts came to, for a failure's message
        (what the ledger says, or why it could not be read: a fault test's database may be down)."""
        try:
            said = [
                f"{a.kind} {a.attempt_number} {a.attempt_class}" + (f" ({a.error[:160]})" if a.error else "")
                for a in self.attempts(operation_id)
            ]
            return f"now {self.op(operation_id).status}; attempts: " + ("; ".join(said) or "none")
        except Exception as exc:  # noqa: BLE001 - a message must not hide the timeout it explains
            return f"the ledger could not be read: {type(exc).__name__}"

    # -- time as an input -----------------------------------------------------------------
    @property
    def lease_s(self) -> float:
        return float(self.env["OUTBOX_LEASE_S"])

    def advance_ledger_clock(self, seconds: float, operation_ids: Collection[str] | None = None) -> int:
        """Move the ledger's clock forward (outbox.testing.advance_ledger_clock): leases run out, due
        times arrive, deadlines and settle windows pass, without waiting. The relay's next tick (and
        the workers the doorbells reach) act on it."""
        from outbox.testing import advance_ledger_clock

        return advance_ledger_clock(self.sessions.kw["bind"], seconds, operation_ids=operation_ids)

    def advance_to_due(self, operation_id: str) -> float:
        """Move this operation's clock (only) to its next due time (``next_attempt_at``), so the
        relay rings it at once; returns the seconds moved (0 if it was due already)."""
        from outbox.ledger.clock import as_utc, db_now

        with self.sessions() as s:
            due, now = s.execute(select(Operation.next_attempt_at, db_now()).where(Operation.id == operation_id)).one()
        left = (as_utc(due) - as_utc(now)).total_seconds()  # type: ignore[operator]
        if left <= 0:
            return 0.0
        self.advance_ledger_clock(left + 0.001, operation_ids=[operation_id])
        return left + 0.001

    def wait_attempt_done(
        self, operation_id: str, number: int, kind: str = "dispatch", timeout_s: float = 15.0
    ) -> Attempt:
        """Attempt ``number`` (1-based) of ``kind``, once its answer is written down and the
        operation has moved on from it (no longer leased for it)."""

        def done() -> Attempt | None:
            attempts = self.attempts(operation_id, kind)
            if len(attempts) < number or attempts[number - 1].ended_at is None:
                return None
            return attempts[number - 1] if self.op(operation_id).status != "dispatching" else None

        return wait_for(done, timeout_s, what=f"{kind} attempt {number} of {operation_id} written down")

    def advance_breaker_clock(self, seconds: float, target: str = "sandbox") -> None:
        """Move the shared breaker's clock forward for ``target`` (see advance_breaker_clock)."""
        advance_breaker_clock(self.env["OUTBOX_REDIS_URL"], self.env["OUTBOX_BROKER_KEY_PREFIX"], target, seconds)

    def count(self, status: str | None = None) -> int:
        with self.sessions() as s:
            stmt = select(func.count()).select_from(Operation)
            if status:
                stmt = stmt.where(Operation.status == status)
            return int(s.execute(stmt).scalar_one())


@contextmanager
def own_pg_ledger() -> Iterator[tuple[str, Any]]:
    """A migrated ledger on a PostgreSQL cluster of the test's own (tests/pg_cluster.py), for a test
    that stops or restarts its database: the machine's cluster serves every other test at the same
    time (the suite runs in parallel), so no test may restart it. Yields (url, cluster)."""
    import psycopg
    import pytest

    from outbox import migrate
    from outbox.ledger.db import make_engine

    try:
        from tests.pg_cluster import StockCluster

        cluster = StockCluster()
    except SystemExit as exc:  # no initdb here
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to start a PostgreSQL cluster of its own: {exc}")
        pytest.skip(f"cannot start a PostgreSQL cluster here: {exc}")
    with cluster as admin_url:
        name = f"outbox_own_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(admin_url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        url = admin_url.rsplit("/", 1)[0] + f"/{name}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        try:
            yield url, cluster
            if cluster.running():  # a test may leave its cluster stopped
                engine.dispose()  # its pooled connections may predate a restart
                record_moves(engine)
        finally:
            engine.dispose()


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
    keys = [
        key
        for pattern in (f"{prefix}*", f"agent-outbox:breaker:{prefix}*", f"agent-outbox:pacing:{prefix}*")
        for key in r.scan_iter(match=pattern, count=500)
    ]
    if keys:
        r.delete(*keys)


class PrivateRedis:
    """A redis-server of the test's own (no persistence) on a free port: safe to SIGKILL and restart.

    The shared Redis on 6379 serves other runs; broker-restart tests point OUTBOX_BROKER_URL here.
    """

    def __init__(self, tmp: Path, port: int | None = None) -> None:
        from workers.sandbox.testing import free_port

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


def database_sessions(url: str) -> int:
    """Sessions ever opened to a PostgreSQL database (pg_stat_database; each backend counts at its
    first transaction, and the statistics reach the view within a second): how many connections a
    server process opened, whatever its pool says."""
    import psycopg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (parsed.database,)).fetchone()
    return int(row[0]) if row else 0
