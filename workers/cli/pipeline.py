"""Running the pipeline: ``relay``, ``worker``, ``sweep --once`` and ``run`` (relay + workers).

``agent-outbox run`` starts the same pieces production runs as separate processes: a Celery
worker process (its prefork children do dispatch and reconcile) and the relay (which also sweeps
expired leases and re-publishes lost doorbells). Configuration comes from ``OUTBOX_*`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING

from outbox.settings import Settings, load_settings
from workers.cli.flags import add_log_level, log_level
from workers.cli.ledger import LedgerUnreachable, open_engine, shown

if TYPE_CHECKING:  # imported where used: the CLI starts without Celery
    from sqlalchemy import Engine

    from workers.relay.fleet import RelayGroup
    from workers.relay.loop import Relay

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def worker_command(
    settings: Settings,
    *,
    concurrency: int | None = None,
    queues: str = "dispatch,outcome_unknown",
    loglevel: str = "INFO",
    name: str | None = None,
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers",
        "worker",
        "-Q",
        queues,
        "-c",
        str(concurrency or settings.worker_concurrency),
        "--loglevel",
        loglevel,
        "-n",
        name or f"outbox-{os.getpid()}@%h",
    ]
    if settings.embedded_broker:
        # Broadcast features need fanout exchanges, which the SQLAlchemy transport lacks.
        cmd += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    return cmd


def build_relay(settings: Settings) -> Relay | RelayGroup:
    """The relay on the configured ledger and broker; with OUTBOX_DATABASE_URLS, one relay per
    ledger run as one (workers/relay/fleet.py)."""
    from workers.relay.fleet import RelayGroup

    ledgers = settings.ledger_urls
    if None in ledgers:
        return _relay_on(settings, None, open_engine(settings))
    relays = []
    for name in ledgers:
        try:
            engine = open_engine(settings, ledger=name)
        except LedgerUnreachable as exc:
            # One ledger down must not keep the others' relays from starting: its relay retries.
            log.warning("%s; its relay starts anyway and retries", exc)
            engine = open_engine(settings, ledger=name, ensure_schema=False)
        relays.append(_relay_on(settings, name, engine))
    return RelayGroup(relays)


def _relay_on(settings: Settings, ledger: str | None, engine: Engine) -> Relay:
    from outbox.evidence.sinks import EvidenceSink
    from outbox.ledger.publish import traceparents
    from workers.engine.doorbell import Doorbell
    from workers.relay.loop import Relay
    from workers.wiring.builders import load_actions_for
    from workers.wiring.celery_app import make_app
    from workers.wiring.embedded_broker import cleanup

    url = settings.resolved_broker_url
    doorbell = Doorbell(
        make_app(settings),
        batch=settings.doorbell_batch,
        traces=lambda ids: traceparents(engine, ids),
        ledger=ledger,
    )
    return Relay(
        engine,
        doorbell,
        poll_s=settings.relay_poll_s,
        republish_after_s=settings.republish_after_s,
        linger_s=settings.relay_linger_s,
        embedded_broker_cleanup=(lambda: cleanup(url)) if settings.embedded_broker else None,
        evidence_sink=EvidenceSink.from_url(settings.evidence_url) if settings.evidence_url else None,
        # For handoff packets (what to mask); without the file every argument is masked.
        actions=load_actions_for(settings) if settings.actions_file else None,
        max_queued=settings.relay_max_queued,
    )


def _term_when_parent_dies() -> None:
    """In the worker's child process before exec: SIGTERM when the process that started it dies.

    Linux's prctl(PR_SET_PDEATHSIG); elsewhere nothing (the worker then outlives a killed parent,
    as any child does)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Pipeline:
    """Relay in a thread of this process + one Celery worker subprocess."""

    def __init__(
        self,
        settings: Settings,
        *,
        concurrency: int | None = None,
        loglevel: str = "WARNING",
        env: dict[str, str] | None = None,
        worker_output: int | None = None,
    ) -> None:
        self.settings = settings
        self.concurrency = concurrency
        self.loglevel = loglevel
        self.env = env
        self.worker_output = worker_output
        self.worker: subprocess.Popen[bytes] | None = None
        self.relay_thread: threading.Thread | None = None
        self.relay: Relay | RelayGroup | None = None
        self._stopping = False

    def start(self) -> None:
        from workers.wiring.builders import load_actions_for

        load_actions_for(self.settings)  # a malformed actions file fails here, with its path
        self.relay = relay = build_relay(self.settings)
        self.worker = subprocess.Popen(
            worker_command(self.settings, concurrency=self.concurrency, loglevel=self.loglevel),
            env=self.env,
            stdout=self.worker_output,
            stderr=self.worker_output,
            # Its own process group, so that ``stop`` can end the worker AND its pool's children at
            # once when the warm shutdown does not finish (killing the main process alone left the
            # prefork children running under PID 1), and a Ctrl-C reaches it only through ``stop``
            # (the relay first, then the worker). The death signal: killed by -9, this process
            # cannot stop it, so the kernel tells the worker to shut down warm (Linux only).
            process_group=0,
            preexec_fn=_term_when_parent_dies,
        )
        self.relay_thread = threading.Thread(target=relay.run_forever, name="relay", daemon=True)
        self.relay_thread.start()

    def alive(self) -> bool:
        """The worker process and the relay thread both run."""
        return (
            self.worker is not None
            and self.worker.poll() is None
            and self.relay_thread is not None
            and self.relay_thread.is_alive()
        )

    def died(self) -> str | None:
        """Which part ended on its own (not through ``stop``), and how; None while both run."""
        if self._stopping or self.worker is None:
            return None
        code = self.worker.poll()
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            return f"the worker process ended ({how})"
        if self.relay_thread is not None and not self.relay_thread.is_alive():
            return "the relay stopped"
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stopping = True
        if self.relay is not None:
            self.relay.stop()
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)  # warm shutdown: finish the current task
            try:
                self.worker.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.worker.pid, signal.SIGKILL)  # the main process and its pool's children
                self.worker.wait()
        if self.relay_thread is not None:
            self.relay_thread.join(timeout_s)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("run", help="run relay + workers with the OUTBOX_* configuration (Ctrl-C stops)")
    p.add_argument("--concurrency", type=int, help="worker processes (default OUTBOX_WORKER_CONCURRENCY)")
    add_log_level(p, what="the log output of the relay and the worker (default: info for the worker)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("relay", help="run the relay (publishes due operations; sweeps expired leases)")
    p.add_argument("--once", action="store_true", help="one tick, then exit (prints what it did)")
    p.set_defaults(func=cmd_relay)
    p = sub.add_parser("sweep", help="expire leases and re-publish lost doorbells")
    p.add_argument("--once", action="store_true", required=True, help="one sweep, then exit")
    p.set_defaults(func=cmd_relay)
    p = sub.add_parser("worker", help="run a Celery worker (same as `celery -A workers worker ...`)")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--queues", default="dispatch,outcome_unknown")
    add_log_level(p, what="the worker's log output (default info)")
    p.set_defaults(func=cmd_worker)


def cmd_relay(args: argparse.Namespace) -> int:
    settings = load_settings()
    relay = build_relay(settings)
    if args.once:
        return _relay_once(relay)
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    if settings.metrics_port:
        from workers.ground import metrics

        metrics.serve(settings.metrics_port)
    try:
        relay.run_forever()
    except KeyboardInterrupt:
        relay.stop()
    return 0


def _relay_once(relay: Relay | RelayGroup) -> int:
    """One tick of each ledger's relay, each reported on its own line; 1 if a ledger's failed."""
    from workers.ground.outage import OUTAGES
    from workers.relay.fleet import RelayGroup

    failed = 0
    for one in relay.relays if isinstance(relay, RelayGroup) else [relay]:
        one._last_sweep = -1e9  # a one-shot sweep always sweeps
        ledger = "" if one.doorbell.ledger is None else f"ledger {one.doorbell.ledger}: "
        try:
            tick = one.run_once()
        except OUTAGES as exc:
            failed += 1
            print(f"{ledger}unreachable ({type(exc).__name__}); nothing done there", file=sys.stderr)
            continue
        print(
            f"{ledger}expired leases: {tick.expired}; dispatch doorbells: {tick.dispatch}; "
            f"reconcile doorbells: {tick.reconcile}"
        )
    return 1 if failed else 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = load_settings()
    from workers.wiring.builders import load_actions_for

    load_actions_for(settings)
    cmd = worker_command(settings, concurrency=args.concurrency, queues=args.queues, loglevel=log_level(args, "INFO"))
    os.execv(cmd[0], cmd)
    return 0  # pragma: no cover


def cmd_run(args: argparse.Namespace) -> int:
    settings = load_settings()
    pipeline = Pipeline(settings, concurrency=args.concurrency, loglevel=log_level(args, "INFO"))
    from workers.ground import logs, metrics

    metrics.wipe_multiproc_dir()
    pipeline.start()
    ledgers = ", ".join(
        shown(url) if name is None else f"{name}={shown(url)}" for name, url in settings.ledger_urls.items()
    )
    logs.say(
        f"agent-outbox running: ledger {ledgers}, broker {settings.resolved_broker_url}; Ctrl-C stops",
        logger=__name__,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    died = None
    try:
        while not stop.is_set() and died is None:
            stop.wait(1.0)
            died = pipeline.died()
    except KeyboardInterrupt:
        pass
    finally:
        pipeline.stop()
    if died is not None:
        # Its output went to this terminal (above); say plainly that it is why we stop.
        logs.say(f"agent-outbox run: {died}; stopping (see its output above)", level=logging.ERROR, logger=__name__)
        return 1
    return 0
