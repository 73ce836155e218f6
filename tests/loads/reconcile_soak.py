"""A steady load on the reconciler: does the outcome_unknown backlog stay bounded?

A burst settles before a backlog shows; a steady rate for minutes shows whether the reconciler
keeps up. Set-up of one run:

- PostgreSQL: a throwaway database here (``bench/scratch_database.py``), the test's ``pg_ledger``
  in ``tests/faults/test_reconcile_soak.py``; a PRIVATE redis-server as broker and breaker store;
- the sandbox provider with the provider's first-request mix of ``tests/loads/liveness.py`` (resets,
  504s, stalls and truncated bodies after commit, 503/429, 500), its after-commit share scaled by
  ``ambiguous_scale`` (so more first requests end outcome_unknown), and optionally every lookup
  slowed by ``lookup_latency_ms`` (a real provider's search is tens of milliseconds, the sandbox's
  one);
- two dispatch workers (prefork ``-c 2``) and ONE reconciler as docs/how-to/deploy.md starts it
  (``celery -A workers worker -Q outcome_unknown -c 1``), the relay polling every
  ``relay_poll_s`` (the default 0.5 s); optionally a dispatch worker SIGKILLed at each of
  ``kill_at_s`` (its claims expire into outcome_unknown);
- intents submitted at ``rate`` per second for ``duration_s``, then the pipeline drains.

Sampled every second: the outcome_unknown backlog, its oldest age (since submit, as
``outbox_outcome_unknown_oldest_age_seconds``), the lookups due now and how long the oldest has
waited since it came due. Checked once quiet: scale_proof's invariants (no duplicate effect,
nothing lost, every state true against the provider, budgets kept, handoff packets complete),
and every handoff's reason: none may be "deadline passed" (an operation whose deadline went by
while it queued for a lookup).

    .venv/bin/python -m bench.reconcile_soak [--rate 70] [--duration 120] [--ambiguous-scale 1]
        [--lookup-latency-ms 0] [--deadline 120] [--kill-every 0] [--reconcilers 1 --concurrency 1]
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads.cpu_split import CpuSplit  # noqa: E402
from tests.loads.liveness import ENV, FIRST_REQUEST_MIX, MAX_ATTEMPTS, READ_TIMEOUT_S  # noqa: E402
from tests.loads.scale_proof import (  # noqa: E402
    ACTIONS,
    NOT_QUIET,
    SUBMIT_RETRY_S,
    ScaleResult,
    _check,
    _log,
    _status_counts,
    private_broker_pipeline,
)

AFTER_COMMIT = {"commit_then_drop", "commit_then_504", "commit_then_stall", "truncated_body"}
SAMPLE_S = 1.0
# A reconcile task that claims and looks up anything takes longer than this (a lookup is a round
# trip to the provider, a claim and a settlement two commits).
FAST_TASK_S = 0.01
# Production's relay poll (OUTBOX_RELAY_POLL_S): the harness's 0.1 s would hide a relay that rings
# reconcile doorbells only at its ticks.
RELAY_POLL_S = 0.5


def soak_rules(
    seed: int, *, ambiguous_scale: float = 1.0, lookup_latency_ms: float = 0.0, post_latency_ms: float = 0.0
) -> list[dict[str, Any]]:
    """The first-request mix as sandbox rules, the after-commit (ambiguous) shares scaled; a
    lookup latency rule first when asked for (it matches GETs only); a latency rule for the POSTs
    the mix leaves alone last when asked for (a provider whose clean answers take that long)."""
    mix = [(m, s * ambiguous_scale if m in AFTER_COMMIT else s, extra) for m, s, extra in FIRST_REQUEST_MIX]
    if sum(s for _, s, _ in mix) >= 1.0:
        raise ValueError("ambiguous_scale leaves no share for clean first requests")
    rules: list[dict[str, Any]] = []
    if lookup_latency_ms:
        rules.append({"mode": "latency", "latency_ms": lookup_latency_ms, "method": "GET", "path": "/v1/*"})
    left = 1.0
    for n, (mode, share, extra) in enumerate(mix):
        rules.append(
            {
                "mode": mode,
                "probability": share / left,
                "first_per_key": True,
                "method": "POST",
                "path": "/v1/*",
                "seed": seed * 100 + n,
                **extra,
            }
        )
        left -= share
    if post_latency_ms:
        rules.append({"mode": "latency", "latency_ms": post_latency_ms, "method": "POST", "path": "/v1/*"})
    return rules


def soak_actions_doc(sandbox_url: str, *, deadline_s: float) -> dict[str, Any]:
    from tests.harness import action, actions_doc

    budget = {"max_attempts": MAX_ATTEMPTS, "deadline_s": deadline_s, "base_delay_s": 0.2, "max_delay_s": 2}
    actions = {
        name: action(path, budget=budget, **({"decimal_args": ["amount"]} if "refund" in name else {}))
        for name, (path, _, _) in ACTIONS.items()
    }
    return actions_doc(
        sandbox_url, timeout_s=READ_TIMEOUT_S, breaker={"fail_max": 20, "reset_timeout_s": 2}, actions=actions
    )


@dataclass
class Steady:
    """Intents at ``rate`` per second for ``duration_s``, submitted by a thread of their own in
    one transaction per tick (as many as the rate owes since the start)."""

    sessions: sessionmaker[Session]
    rate: float
    duration_s: float
    key_prefix: str
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # op id -> (action, provider key)
    errors: list[BaseException] = field(default_factory=list)
    thread: threading.Thread | None = None
    submitted: int = 0
    behind_s: float = 0.0  # the most the submitter fell behind its schedule
    # (seconds since start, seconds the tick's transaction took, intents in it): intake latency
    ticks: list[tuple[float, float, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return int(self.rate * self.duration_s)

    def start(self) -> float:
        started = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(started,), name="steady-submit", daemon=True)
        self.thread.start()
        return started

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _run(self, started: float) -> None:
        try:
            while self.submitted < self.total:
                owed = min(int(self.rate * (time.monotonic() - started)), self.total)
                if owed > self.submitted:
                    began = time.monotonic()
                    n = owed - self.submitted
                    self._submit(self.submitted, owed)
                    self.ticks.append((began - started, time.monotonic() - began, n))
                    self.behind_s = max(self.behind_s, time.monotonic() - started - self.submitted / self.rate)
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported as a violation by the caller
            self.errors.append(exc)

    def _submit(self, first: int, end: int) -> None:
        from sqlalchemy.exc import DBAPIError

        from producer import submit

        names = list(ACTIONS)
        give_up = time.monotonic() + SUBMIT_RETRY_S
        while True:
            receipts: dict[str, tuple[str, str]] = {}
            try:
                with self.sessions.begin() as s:
                    for i in range(first, end):
                        name = names[i % len(names)]
                        key = f"{self.key_prefix}-{i:06d}"
                        r = submit(
                            s, tenant="t1", idempotency_key=key, action=name, args=ACTIONS[name][2](i), subject="soak"
                        )
                        receipts[r.operation_id] = (name, r.provider_key or key)
            except DBAPIError:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.5)
                continue
            self.keys.update(receipts)
            self.submitted = end
            return


@dataclass
class Sample:
    t: float
    submitted: int
    settled: int
    unknown: int  # operations in outcome_unknown
    oldest_s: float  # since the oldest of them was submitted
    due: int  # outcome_unknown operations whose lookup is due now (lease free)
    due_wait_s: float  # since the oldest due lookup came due
    dispatch_due: int = 0  # not_dispatched operations due now (waiting for a worker)
    dispatch_wait_s: float = 0.0  # since the oldest of them came due


def _sample(sessions: sessionmaker[Session], t: float, submitted: int) -> Sample:
    from outbox.ledger.clock import db_age_s
    from outbox.ledger.models import Operation

    unknown = Operation.status == "outcome_unknown"
    with sessions() as s:
        n, oldest = s.execute(select(func.count(), db_age_s(func.min(Operation.created_at))).where(unknown)).one()
        due, due_wait = s.execute(
            select(func.count(), db_age_s(func.min(Operation.next_attempt_at))).where(
                unknown,
                Operation.next_attempt_at <= func.now(),
                (Operation.lease_expires_at.is_(None)) | (Operation.lease_expires_at < func.now()),
            )
        ).one()
        waiting, waited = s.execute(
            select(func.count(), db_age_s(func.min(Operation.next_attempt_at))).where(
                Operation.status == "not_dispatched", Operation.next_attempt_at <= func.now()
            )
        ).one()
        counts = dict(s.execute(select(Operation.status, func.count()).group_by(Operation.status)).all())
    settled = sum(v for k, v in counts.items() if k not in NOT_QUIET)
    return Sample(
        t,
        submitted,
        settled,
        int(n),
        float(oldest or 0.0),
        int(due),
        max(float(due_wait or 0.0), 0.0),
        int(waiting),
        max(float(waited or 0.0), 0.0),
    )


@dataclass
class SoakResult:
    scale: ScaleResult
    rate: float
    duration_s: float
    reconcilers: int
    concurrency: int
    ambiguous_scale: float
    lookup_latency_ms: float
    deadline_s: float
    samples: list[Sample] = field(default_factory=list)
    drain_s: float | None = None  # from the last submit to an empty outcome_unknown
    handoffs: Counter[str] = field(default_factory=Counter)  # reason (first 100 characters) -> count
    deadline_handoffs: int = 0  # handed to a person with "deadline passed" in the reason
    lookups: int = 0  # lookup attempt rows
    reconcile_tasks: int = 0  # from the reconciler's log
    fast_tasks: int = 0  # reconcile tasks done in under FAST_TASK_S (before lookups were handed off:
    # a claim that found nothing)
    worker_kills: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    settle_p99_s: dict[str, float] = field(default_factory=dict)  # first / last third of arrivals
    # (t, {kind: MiB per process}) every RSS_EVERY_S: the reconcilers, the dispatch workers alive then
    # (a killed one's replacement starts afresh: its growth shows within its lifetime; the relay is a
    # thread of the bench's own process).
    rss: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    ticks: list[tuple[float, float, int]] = field(default_factory=list)  # the submitter's (Steady.ticks)

    def _thirds(self) -> tuple[list[Sample], list[Sample]]:
        during = [x for x in self.samples if x.t <= self.duration_s]
        k = max(len(during) // 3, 1)
        return during[:k], during[-k:]

    @property
    def backlog_thirds(self) -> tuple[float, float]:
        """Mean outcome_unknown backlog over the first and the last third of the arrivals."""
        first, last = self._thirds()
        return mean(x.unknown for x in first), mean(x.unknown for x in last)

    @property
    def oldest_thirds(self) -> tuple[float, float]:
        """Mean oldest age (s) over the first and the last third of the arrivals."""
        first, last = self._thirds()
        return mean(x.oldest_s for x in first), mean(x.oldest_s for x in last)

    @property
    def due_wait_max_s(self) -> float:
        return max((x.due_wait_s for x in self.samples), default=0.0)

    @property
    def peak_backlog(self) -> int:
        return max((x.unknown for x in self.samples), default=0)

    @property
    def drain_per_s(self) -> float | None:
        """outcome_unknown operations settled per second after the arrivals ended."""
        end = [x for x in self.samples if x.t >= self.duration_s]
        if not end or self.drain_s is None or self.drain_s <= 0:
            return None
        return end[0].unknown / self.drain_s

    def summary(self) -> str:
        (b1, b3), (o1, o3) = self.backlog_thirds, self.oldest_thirds
        drain = self.drain_per_s
        return (
            f"reconcile soak rate={self.rate:g}/s duration={self.duration_s:g}s reconcilers={self.reconcilers}x"
            f"-c{self.concurrency} ambiguous_scale={self.ambiguous_scale:g} lookup_latency={self.lookup_latency_ms:g}ms "
            f"deadline={self.deadline_s:g}s | backlog first/last third {b1:.0f}/{b3:.0f} peak {self.peak_backlog} | "
            f"oldest age first/last third {o1:.1f}/{o3:.1f}s | due lookup waited max {self.due_wait_max_s:.1f}s | "
            f"drain {'-' if self.drain_s is None else f'{self.drain_s:.1f}s'}"
            f" ({'-' if drain is None else f'{drain:.1f}/s'}) | settle p99 first/last third "
            f"{self.settle_p99_s.get('first', 0):.1f}/{self.settle_p99_s.get('last', 0):.1f}s | "
            f"lookups={self.lookups} reconcile_tasks={self.reconcile_tasks} fast_tasks={self.fast_tasks} | "
            f"statuses={dict(self.scale.statuses)} handoffs={sum(self.handoffs.values())} "
            f"deadline_handoffs={self.deadline_handoffs} duplicates={self.scale.duplicates} lost={self.scale.lost} "
            f"worker_kills={self.worker_kills} violations={len(self.scale.violations)}"
        )

    def as_json(self) -> dict[str, Any]:
        return self.scale.as_json() | {
            "rate": self.rate,
            "duration_s": self.duration_s,
            "reconcilers": self.reconcilers,
            "concurrency": self.concurrency,
            "ambiguous_scale": self.ambiguous_scale,
            "lookup_latency_ms": self.lookup_latency_ms,
            "deadline_s": self.deadline_s,
            "backlog_thirds": self.backlog_thirds,
            "oldest_thirds": self.oldest_thirds,
            "peak_backlog": self.peak_backlog,
            "due_wait_max_s": self.due_wait_max_s,
            "drain_s": self.drain_s,
            "drain_per_s": self.drain_per_s,
            "settle_p99_s": self.settle_p99_s,
            "handoffs": dict(self.handoffs),
            "deadline_handoffs": self.deadline_handoffs,
            "lookups": self.lookups,
            "reconcile_tasks": self.reconcile_tasks,
            "fast_tasks": self.fast_tasks,
            "worker_kills": self.worker_kills,
            "cpu_s": self.cpu_s,
            "rss_mib": [[round(t, 1), {k: round(v, 1) for k, v in r.items()}] for t, r in self.rss],
            "rss_growth": rss_growth(self.rss, self.duration_s),
            "samples": [
                [
                    round(x.t, 1),
                    x.submitted,
                    x.settled,
                    x.unknown,
                    round(x.oldest_s, 1),
                    x.due,
                    round(x.due_wait_s, 1),
                    x.dispatch_due,
                    round(x.dispatch_wait_s, 1),
                ]
                for x in self.samples
            ],
        }


RSS_EVERY_S = 10.0


def _rss_per_process(pids: list[int]) -> float:
    """Mean RSS in MiB of these processes and their children (a prefork parent and its pool)."""
    from tests.loads.procs import _children, _rss_kib

    tree = [q for p in pids for q in (p, *_children(p))]
    found = [k for k in (_rss_kib(q) for q in tree) if k]
    return sum(found) / len(found) / 1024 if found else 0.0


def rss_growth(rss: list[tuple[float, dict[str, float]]], duration_s: float) -> dict[str, float]:
    """Per kind of process: mean RSS over the last third of the arrivals / over the first third, - 1."""
    during = [r for t, r in rss if t <= duration_s]
    k = max(len(during) // 3, 1)
    out = {}
    for kind in during[0] if during else {}:
        first = mean(r[kind] for r in during[:k] if r.get(kind))
        last = mean(r[kind] for r in during[-k:] if r.get(kind))
        out[kind] = last / first - 1 if first else 0.0
    return out


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def run_soak(
    *,
    db_url: str,
    sessions: sessionmaker[Session],
    sandbox: Any,
    tmp: Path,
    rate: float = 70.0,
    duration_s: float = 120.0,
    seed: int = 7,
    ambiguous_scale: float = 1.0,
    lookup_latency_ms: float = 0.0,
    post_latency_ms: float = 0.0,
    deadline_s: float = 120.0,
    reconcilers: int = 1,
    concurrency: int = 1,
    dispatchers: int = 2,
    kill_at_s: tuple[float, ...] = (),
    relay_poll_s: float = RELAY_POLL_S,
    drain_within_s: float = 300.0,
    env: dict[str, str] | None = None,
    reconciler_env: dict[str, str] | None = None,
    verbose: bool = False,
) -> SoakResult:
    """Run one soak against an EMPTY migrated ledger and a sandbox (reset here). ``env``: settings
    for every process; ``reconciler_env``: for the reconcilers only (e.g. a smaller
    OUTBOX_MAX_IN_FLIGHT, to see capacity grow with processes)."""
    import random

    from outbox.ledger.models import Attempt, Operation

    result = SoakResult(
        ScaleResult(seed=seed, intents=0, workers=dispatchers),
        rate=rate,
        duration_s=duration_s,
        reconcilers=reconcilers,
        concurrency=concurrency,
        ambiguous_scale=ambiguous_scale,
        lookup_latency_ms=lookup_latency_ms,
        deadline_s=deadline_s,
    )
    rng = random.Random(seed)
    sandbox.reset()
    sandbox.configure(request_log_max=max(100_000, int(rate * duration_s * 20)))
    rules = soak_rules(
        seed, ambiguous_scale=ambiguous_scale, lookup_latency_ms=lookup_latency_ms, post_latency_ms=post_latency_ms
    )
    for rule in rules:
        sandbox.add_fault(**rule)
    run_env = ENV | {"OUTBOX_RELAY_POLL_S": str(relay_poll_s)} | (env or {})
    with private_broker_pipeline(db_url=db_url, sessions=sessions, sandbox=sandbox, tmp=tmp, env=run_env) as (
        pipe,
        _redis,
    ):
        pipe.write_actions(soak_actions_doc(sandbox.url, deadline_s=deadline_s))
        workers = [
            pipe.start_worker(f"d{i + 1}", queues="dispatch", pool="prefork", concurrency=2) for i in range(dispatchers)
        ]
        recs = [
            pipe.start_worker(
                f"reconciler{i + 1}",
                queues="outcome_unknown",
                pool="prefork",
                concurrency=concurrency,
                extra_env=reconciler_env,
            )
            for i in range(reconcilers)
        ]
        pipe.start_relay(poll_s=relay_poll_s, republish_after_s=10.0)
        submitter = Steady(sessions, rate, duration_s, key_prefix=f"soak-{seed}")
        cpu = CpuSplit().__enter__()
        started = submitter.start()
        kills = sorted(kill_at_s)
        last_print = 0.0
        ended_at: float | None = None
        while True:
            t = time.monotonic() - started
            try:
                sample = _sample(sessions, t, submitter.submitted)
            except Exception:  # noqa: BLE001 - a sample missed is not a result
                time.sleep(SAMPLE_S)
                continue
            result.samples.append(sample)
            if not result.rss or t - result.rss[-1][0] >= RSS_EVERY_S:
                result.rss.append(
                    (
                        t,
                        {
                            "reconciler": _rss_per_process([r.pid for r in recs]),
                            "dispatch": _rss_per_process([w.pid for w in workers]),
                        },
                    )
                )
            if kills and t >= kills[0] and submitter.is_alive():
                kills.pop(0)
                victim = workers.pop(rng.randrange(len(workers)))
                victim.kill()
                result.worker_kills += 1
                workers.append(
                    pipe.start_worker(
                        f"d{dispatchers + result.worker_kills}", queues="dispatch", pool="prefork", concurrency=2
                    )
                )
                _log(f"dispatch worker {victim.name} killed", verbose)
            if verbose and t - last_print >= 10:
                last_print = t
                _log(
                    f"t={t:.0f}s submitted={sample.submitted} settled={sample.settled} unknown={sample.unknown} "
                    f"oldest={sample.oldest_s:.1f}s due={sample.due} due_wait={sample.due_wait_s:.1f}s",
                    verbose,
                )
            if submitter.errors:
                result.scale.violations.append(f"submit failed: {submitter.errors[0]!r}")
                break
            if not submitter.is_alive():
                if ended_at is None:
                    ended_at = t
                counts = _status_counts(sessions)
                if sample.unknown == 0 and result.drain_s is None:
                    result.drain_s = t - ended_at
                if sum(counts[st] for st in NOT_QUIET) == 0:
                    if result.drain_s is None:
                        result.drain_s = t - ended_at
                    break
                if t - ended_at > drain_within_s:
                    result.scale.violations.append(
                        f"I2: not quiet {drain_within_s:.0f}s after the last submit: {dict(counts)}"
                    )
                    break
            time.sleep(max(0.0, SAMPLE_S - (time.monotonic() - started - t)))
        result.scale.wall_s = time.monotonic() - started
        cpu.__exit__()
        result.cpu_s = cpu.seconds
        result.scale.intents = len(submitter.keys)
        result.ticks = submitter.ticks
        result.scale.worker_kills = result.worker_kills
        for w in workers + recs:
            w.stop()
        reconciler_log = "".join(r.log() for r in recs)
        took = [float(x) for x in re.findall(r"succeeded in ([0-9.]+)s", reconciler_log)]
        result.reconcile_tasks = len(took)
        result.fast_tasks = sum(1 for x in took if x < FAST_TASK_S)
        _check(result.scale, sessions, sandbox, submitter.keys, max_attempts=MAX_ATTEMPTS)
        with sessions() as s:
            result.lookups = int(
                s.execute(select(func.count()).select_from(Attempt).where(Attempt.kind == "lookup")).scalar_one()
            )
            for reason, n in s.execute(
                select(Operation.reason, func.count())
                .where(Operation.status == "reconciliation_required")
                .group_by(Operation.reason)
            ).all():
                result.handoffs[(reason or "")[:100]] += n
                if "deadline passed" in (reason or ""):
                    result.deadline_handoffs += n
            rows = s.execute(
                select(Operation.created_at, Operation.finished_at).where(Operation.finished_at.is_not(None))
            ).all()
        t0 = min((c for c, _ in rows), default=None)
        if t0 is not None:
            third = duration_s / 3
            first = [(f - c).total_seconds() for c, f in rows if (c - t0).total_seconds() < third]
            last = [(f - c).total_seconds() for c, f in rows if (c - t0).total_seconds() >= 2 * third]
            result.settle_p99_s = {"first": _p99(first), "last": _p99(last)}
    return result
