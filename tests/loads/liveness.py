"""Liveness at scale under faults (issue 14): many intents, a provider that fails ~45% of first
requests, and the process faults of FAULTS.md, all in one run; every payable intent must succeed
within its deadline, with no duplicate effect and every state true.

One implementation, used by ``python -m bench.liveness`` and by ``tests/faults/test_liveness.py`` (same size:
10,000 intents). Set-up of one run:

- PostgreSQL: a throwaway database here (``bench/scratch_database.py``), the test's ``pg_ledger``
  in the test; a PRIVATE redis-server as broker and breaker store;
- the sandbox provider with the issue's mix on each key's FIRST request (``first_per_key``): reset
  after commit 10%, 504 after commit 8%, a 4 s stall after commit 5% (past the 1.5 s read
  timeout), truncated 200 5%, 503 + Retry-After 8%, 429 + Retry-After as an HTTP-date 5%, 500
  before commit 4%; every retry of a key succeeds;
- two dispatch workers and a reconciler (prefork, ``-c 2`` each), the relay in a thread;
  budget 5 attempts, 120 s deadline;
- N intents submitted in a burst (100 per transaction) while everything runs.

Process faults, by progress (so they land while work is in flight): at 10% settled the broker
(Redis) is SIGKILLed and restarted empty; at 25% a dispatch worker and its pool are SIGKILLed and
replaced; at 40% PostgreSQL restarts (``pg_ctlcluster -m immediate restart``); at 55% the
provider resets every request for 8 s; at 70% a dispatch worker is frozen (SIGSTOP) past its
lease for FREEZE_S, then thawed.

Checked once quiet: scale_proof's invariants (no duplicate effect, nothing lost, every state true
against the provider, budgets kept, handoff packets complete), plus: every operation succeeded
(the mix has no business rejection: all are payable) within its deadline. Sampled every 0.25 s:
dispatch doorbells in the broker against due operations.

    .venv/bin/python -m bench.liveness [--intents 10000] [--seed 7] [--only clean|mix|faults]

Runs three scenarios: ``clean`` (no fault), ``mix`` (the provider's first-request mix only: the
throughput under faults) and ``faults`` (the mix plus the process faults: liveness); prints each
and the ratios to clean, writes JSON to bench/results/; exits 1 on any violation.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads.cpu_split import CpuSplit  # noqa: E402
from tests.loads.scale_proof import (  # noqa: E402
    ACTIONS,
    NOT_QUIET,
    Burst,
    QuietHold,
    ScaleResult,
    _check,
    _log,
    _status_counts,
    private_broker_pipeline,
)

MAX_ATTEMPTS = 5
DEADLINE_S = 120
READ_TIMEOUT_S = 1.5
OUTAGE_S = 8.0
FREEZE_S = 10.0  # past the lease below: the frozen worker's claims expire and are looked up
SAMPLE_S = 0.25
# A run's pipeline settings: soft < hard < lease < visibility, and a call (1.5 s read + 0.5 s
# connect) within the soft limit.
ENV = {
    "OUTBOX_SOFT_TIME_LIMIT_S": "5",
    "OUTBOX_TIME_LIMIT_S": "6",
    "OUTBOX_LEASE_S": "8",
    "OUTBOX_DOORBELL_BATCH": "10",
}
# The mix: share of FIRST requests per key (45% in all); (mode, share, extra rule fields).
FIRST_REQUEST_MIX: list[tuple[str, float, dict[str, Any]]] = [
    ("commit_then_drop", 0.10, {}),
    ("commit_then_504", 0.08, {}),
    ("commit_then_stall", 0.05, {"stall_s": 4.0}),
    ("truncated_body", 0.05, {}),
    ("unavailable_503", 0.08, {"retry_after_s": 1}),
    ("rate_limited_429", 0.05, {"retry_after_s": 1, "retry_after_http_date": True}),
    ("fail_before_commit", 0.04, {"status": 500}),
]


def first_request_rules(
    seed: int, mix: list[tuple[str, float, dict[str, Any]]] = FIRST_REQUEST_MIX
) -> list[dict[str, Any]]:
    """The mix as sandbox rules. Rules are tried in order (first match wins), so each one's
    probability is its share among the requests the rules before it let through."""
    rules, left = [], 1.0
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
    return rules


def liveness_actions_doc(sandbox_url: str, *, on_ambiguous: str = "lookup") -> dict[str, Any]:
    """``on_ambiguous``: lookup (the default: ask the provider) or replay (send again with the same
    key: the sandbox replays by key)."""
    from tests.harness import action, actions_doc

    budget = {"max_attempts": MAX_ATTEMPTS, "deadline_s": DEADLINE_S, "base_delay_s": 0.2, "max_delay_s": 2}
    extra: dict[str, Any] = {"on_ambiguous": on_ambiguous} if on_ambiguous != "lookup" else {}
    actions = {
        name: action(path, budget=budget, **extra, **({"decimal_args": ["amount"]} if "refund" in name else {}))
        for name, (path, _, _) in ACTIONS.items()
    }
    # A breaker that an 8 s outage trips and a 45% first-request failure rate does not.
    return actions_doc(
        sandbox_url, timeout_s=READ_TIMEOUT_S, breaker={"fail_max": 20, "reset_timeout_s": 2}, actions=actions
    )


@dataclass
class Sample:
    t: float
    settled: int
    due: int
    queued: int | None


@dataclass
class LivenessResult:
    scale: ScaleResult
    scenario: str
    samples: list[Sample] = field(default_factory=list)
    faults_done_at: float | None = None  # seconds from the start when the last fault ended
    pg_restarts: int = 0
    outages: int = 0
    # Workers that exited on their own and were started again, as compose's restart policy would
    # (a Celery/kombu bug, see bench/README.md "Issue 14"): (worker, its last log line).
    self_exits: list[tuple[str, str]] = field(default_factory=list)
    over_deadline: int = 0  # succeeded later than the deadline after submit
    queue_over: int = 0  # samples where the broker held more than QUEUE_RATIO x due (+ slack)
    # Dispatch attempt rows by class, and the most frequent reasons of those not sent.
    attempt_classes: Counter[str] = field(default_factory=Counter)
    not_sent_why: Counter[str] = field(default_factory=Counter)
    backlog: bool = False  # every intent submitted before the pipeline started
    submit_s: float | None = None  # how long submitting took (before the pipeline, with --backlog)
    # CPU seconds per kind of process from the start to quiet (tests/loads/cpu_split.py); the bench
    # process holds the relay, the submitter (unless --backlog) and the sampling.
    cpu_s: dict[str, float] = field(default_factory=dict)
    # Redis commands by name from the broker's start (or last restart) to quiet: broker messages
    # (LPUSH, BRPOP) and breaker decisions (EVALSHA) per operation.
    redis_calls: dict[str, int] = field(default_factory=dict)
    # The operations settled last (what the wall's tail waited for): each attempt as
    # "kind class +seconds from submit", and the seconds from submit to settled.
    last_settled: list[dict[str, Any]] = field(default_factory=list)

    @property
    def queue_max(self) -> int:
        return max((s.queued or 0 for s in self.samples), default=0)

    @property
    def after_faults_ops_s(self) -> float | None:
        """Operations settled per second from the end of the last fault to quiet."""
        if self.faults_done_at is None or not self.samples:
            return None
        after = [s for s in self.samples if s.t >= self.faults_done_at]
        if len(after) < 2 or after[-1].t <= after[0].t:
            return None
        return (after[-1].settled - after[0].settled) / (after[-1].t - after[0].t)

    @property
    def cpu_ms_per_op(self) -> dict[str, float]:
        return {k: round(v * 1000 / max(self.scale.intents, 1), 2) for k, v in self.cpu_s.items()}

    @property
    def left_after_faults(self) -> int | None:
        """Operations not yet settled when the last fault ended (what after_faults_ops_s is over:
        a small remainder, e.g. a frozen worker's claims waiting for their leases, gives a low rate
        that says nothing about throughput)."""
        if self.faults_done_at is None or not self.samples:
            return None
        at = next((x for x in self.samples if x.t >= self.faults_done_at), self.samples[-1])
        return self.scale.intents - at.settled

    def summary(self) -> str:
        s = self.scale
        after = self.after_faults_ops_s
        return (
            f"liveness {self.scenario}{' (backlog)' if self.backlog else ''} intents={s.intents} "
            f"submit={'-' if self.submit_s is None else f'{self.submit_s:.1f}s'} wall={s.wall_s:.1f}s "
            f"ops/s={s.ops_per_s:.1f} after_faults_ops/s={'-' if after is None else f'{after:.1f}'} "
            f"left_after_faults={'-' if self.left_after_faults is None else self.left_after_faults} "
            f"succeeded={s.statuses['succeeded']} failed_before_commit={s.statuses['failed_before_commit']} "
            f"reconciliation_required={s.statuses['reconciliation_required']} over_deadline={self.over_deadline} "
            f"reconciled={s.reconciled} retries={s.retries} duplicates={s.duplicates} lost={s.lost} "
            f"queue_max={self.queue_max} queue_over_2x_due={self.queue_over} self_exits={len(self.self_exits)} "
            f"violations={len(s.violations)}"
        )

    def as_json(self) -> dict[str, Any]:
        return self.scale.as_json() | {
            "scenario": self.scenario,
            "backlog": self.backlog,
            "submit_s": self.submit_s,
            "after_faults_ops_per_s": self.after_faults_ops_s,
            "faults_done_at_s": self.faults_done_at,
            "left_after_faults": self.left_after_faults,
            "pg_restarts": self.pg_restarts,
            "outages": self.outages,
            "self_exits": self.self_exits,
            "over_deadline": self.over_deadline,
            "queue_max": self.queue_max,
            "queue_over_2x_due": self.queue_over,
            "attempt_classes": dict(self.attempt_classes),
            "not_sent_why": dict(self.not_sent_why.most_common(10)),
            "cpu_s": self.cpu_s,
            "redis_calls": self.redis_calls,
            "last_settled": self.last_settled,
            "cpu_ms_per_op": self.cpu_ms_per_op,
            "samples": [[round(x.t, 2), x.settled, x.due, x.queued] for x in self.samples],
        }


SCENARIOS = ("clean", "mix", "faults")
# Doorbells a worker process may hold beyond what is due when sampled (one prefetched each, and
# one just published for ids another doorbell's claim took along): the "2x due" check's slack.
QUEUE_SLACK = 8
QUEUE_WINDOW_S = 1.0


def restart_postgres() -> None:
    """``pg_ctlcluster -m immediate restart`` of the local cluster (Debian's postgresql-common)."""
    if shutil.which("pg_lsclusters") is None:
        raise RuntimeError("pg_lsclusters is not installed: the PostgreSQL restart needs Debian's postgresql-common")
    line = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True).stdout
    version, cluster = line.split()[:2]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", "-m", "immediate", version, cluster, "restart"],
        check=True,
        timeout=60,
        capture_output=True,
    )


def _due_count(sessions: sessionmaker[Session]) -> int:
    from outbox.ledger.models import Operation

    with sessions() as s:
        return int(
            s.execute(
                select(func.count()).where(
                    Operation.status == "not_dispatched", Operation.next_attempt_at <= func.now()
                )
            ).scalar_one()
        )


def _last_settled(session: Session, n: int = 5) -> list[dict[str, Any]]:
    from outbox.ledger.models import Attempt, Operation

    last = session.execute(select(Operation).order_by(Operation.updated_at.desc()).limit(n)).scalars().all()
    out = []
    for op in last:
        attempts = session.execute(
            select(Attempt).where(Attempt.operation_id == op.id).order_by(Attempt.started_at)
        ).scalars()
        out.append(
            {
                "settled_after_s": round((op.updated_at - op.created_at).total_seconds(), 2),
                "status": op.status,
                "attempts": [
                    f"{a.kind} {a.attempt_class} +{(a.started_at - op.created_at).total_seconds():.2f}s"
                    for a in attempts
                ],
            }
        )
    return out


def _redis_calls(url: str) -> dict[str, int]:
    import redis as redis_client

    try:
        stats = redis_client.Redis.from_url(url).info("commandstats")
    except redis_client.RedisError:
        return {}
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


def run_liveness(
    *,
    db_url: str,
    sessions: sessionmaker[Session],
    sandbox: Any,
    tmp: Path,
    intents: int = 10_000,
    seed: int = 7,
    scenario: str = "faults",
    on_ambiguous: str = "lookup",
    backlog: bool = False,
    quiet_within_s: float = 600.0,
    verbose: bool = False,
    restart_db: Callable[[], None] | None = None,
) -> LivenessResult:
    """Run one scenario against an EMPTY migrated ledger and a sandbox (reset here).

    ``scenario``: ``clean`` (no fault at all), ``mix`` (the provider's first-request mix only: the
    throughput under faults), ``faults`` (the mix and the process faults: liveness).

    ``backlog``: submit every intent first, then start the pipeline and time it from there (its
    own rate). Otherwise intents are submitted while it runs, by a thread of this process, which
    shares the GIL with the relay's thread and the 2 cores with everything: clean, the pipeline
    then settles as fast as this submitter submits (12.6 s to submit 10,000, 12.9 s to settle,
    2026-12-01), so the burst figure is the submitter's rate, not the pipeline's.

    ``restart_db``: how the PostgreSQL fault restarts the ledger's server (default: the machine's
    cluster, ``restart_postgres``); the test suite passes its own cluster's, since in a parallel run
    the machine's serves every other test."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}")
    clean = scenario == "clean"
    from outbox.ledger.models import Attempt, Operation
    from workers.engine.doorbell import Doorbell
    from workers.wiring.celery_app import make_app

    result = LivenessResult(ScaleResult(seed=seed, intents=intents, workers=2), scenario=scenario, backlog=backlog)
    rng = random.Random(seed)
    sandbox.reset()
    sandbox.configure(request_log_max=max(100_000, intents * 20))
    if not clean:
        for rule in first_request_rules(seed):
            sandbox.add_fault(**rule)

    with private_broker_pipeline(db_url=db_url, sessions=sessions, sandbox=sandbox, tmp=tmp, env=ENV) as (pipe, redis):
        pipe.write_actions(liveness_actions_doc(sandbox.url, on_ambiguous=on_ambiguous))
        submitter = Burst(sessions, intents, key_prefix=f"live-{seed}", subject="liveness", verbose=verbose)
        keys = submitter.keys
        if backlog:  # every intent due before the pipeline starts: its own rate, not the submitter's
            submit_started = submitter.start()
            submitter.join(600)
            result.submit_s = time.monotonic() - submit_started
        dispatchers = [
            pipe.start_worker(f"d{i + 1}", queues="dispatch", pool="prefork", concurrency=2) for i in range(2)
        ]
        reconcilers = [pipe.start_worker("reconciler", queues="outcome_unknown", pool="prefork", concurrency=2)]
        pipe.start_relay(republish_after_s=10.0)
        doorbell = Doorbell(make_app(pipe.settings()))

        cpu = CpuSplit().__enter__()
        started = time.monotonic() if backlog else submitter.start()
        plan = ["redis", "kill", "postgres", "outage", "freeze"] if scenario == "faults" else []
        at = {"redis": 0.10, "kill": 0.25, "postgres": 0.40, "outage": 0.55, "freeze": 0.70}
        frozen: Any = None
        outage_rule: int | None = None
        ends: dict[str, float] = {}  # fault -> monotonic time it ends
        last_print = 0.0
        quiet = QuietHold()
        while True:
            now = time.monotonic()
            try:
                counts = _status_counts(sessions)
                due = _due_count(sessions)
            except Exception:  # noqa: BLE001 - the ledger is restarting: sample again
                time.sleep(SAMPLE_S)
                continue
            busy = sum(counts[st] for st in NOT_QUIET)
            settled = sum(counts.values()) - busy
            queued = doorbell.queued_dispatch()
            result.samples.append(Sample(now - started, settled, due, queued))
            # Against the most due in the last second: the relay rang for the rows due when it
            # looked; claims taking them along empty the due count faster than the queue.
            recent_due = max([x.due for x in result.samples if x.t >= now - started - QUEUE_WINDOW_S])
            if queued is not None and queued > 2 * recent_due + QUEUE_SLACK:
                result.queue_over += 1
            for group, queue in ((dispatchers, "dispatch"), (reconcilers, "outcome_unknown")):
                for w in [w for w in group if w.proc.poll() is not None and w is not frozen]:
                    # As compose's `restart: unless-stopped` would: start it again, and say so.
                    last = (w.log().strip().splitlines() or ["(no log)"])[-1][:300]
                    result.self_exits.append((w.name, last))
                    _log(f"worker {w.name} exited on its own (rc {w.proc.returncode}); started again", verbose)
                    group.remove(w)
                    group.append(
                        pipe.start_worker(
                            f"{w.name}-r{len(result.self_exits)}", queues=queue, pool="prefork", concurrency=2
                        )
                    )
            if plan and settled >= intents * at[plan[0]]:
                fault = plan.pop(0)
                _log(f"fault {fault} at {settled}/{intents} settled", verbose)
                if fault == "redis":
                    redis.kill()
                    time.sleep(1.0)
                    redis.start()
                    result.scale.redis_restarts += 1
                elif fault == "kill":
                    victim = dispatchers.pop(rng.randrange(len(dispatchers)))
                    victim.kill()
                    result.scale.worker_kills += 1
                    dispatchers.append(
                        pipe.start_worker(
                            f"d{3 + result.scale.worker_kills}", queues="dispatch", pool="prefork", concurrency=2
                        )
                    )
                elif fault == "postgres":
                    (restart_db or restart_postgres)()
                    result.pg_restarts += 1
                elif fault == "outage":
                    rule = sandbox.add_fault(mode="drop_before_commit", probability=1.0)
                    outage_rule = int(rule["id"])
                    ends["outage"] = time.monotonic() + OUTAGE_S
                    result.outages += 1
                elif fault == "freeze":
                    frozen = dispatchers[rng.randrange(len(dispatchers))]
                    frozen.freeze()
                    ends["freeze"] = time.monotonic() + FREEZE_S
                    result.scale.worker_freezes += 1
                ends.setdefault(fault, time.monotonic())
            now = time.monotonic()
            if outage_rule is not None and now >= ends["outage"]:
                sandbox.remove_fault(outage_rule)
                outage_rule = None
                _log("provider back", verbose)
            if frozen is not None and now >= ends["freeze"]:
                frozen.thaw()
                frozen = None
                _log("worker thawed", verbose)
            faults_over = not plan and outage_rule is None and frozen is None
            if faults_over and result.faults_done_at is None and ends:
                result.faults_done_at = max(ends.values()) - started
            if result.submit_s is None and not submitter.is_alive():
                result.submit_s = now - started
            done = not submitter.is_alive() and faults_over and settled >= intents
            if quiet.held(sessions, busy=busy if done else 1, now=now):
                break
            if submitter.errors:
                break
            if now - started > quiet_within_s:
                result.scale.violations.append(f"I2: not quiet after {quiet_within_s:.0f}s: {dict(counts)}")
                break
            if now - last_print > 10:
                last_print = now
                _log(f"{dict(counts)} due={due} queued={queued}", verbose)
            time.sleep(SAMPLE_S)
        result.scale.wall_s = (quiet.began or time.monotonic()) - started  # to when the quiet that held began
        cpu.__exit__()
        result.cpu_s = cpu.seconds
        result.redis_calls = _redis_calls(redis.url)
        submitter.join(30)
        if submitter.errors:
            result.scale.violations.append(f"submit failed: {submitter.errors[0]!r}")
        _check(result.scale, sessions, sandbox, keys, max_attempts=MAX_ATTEMPTS)
        with sessions() as s:
            rows = s.execute(select(Operation.status, Operation.created_at, Operation.updated_at)).all()
            result.last_settled = _last_settled(s)
            for klass, error, n in s.execute(
                select(Attempt.attempt_class, Attempt.error, func.count())
                .where(Attempt.kind == "dispatch")
                .group_by(Attempt.attempt_class, Attempt.error)
            ).all():
                result.attempt_classes[klass] += n
                if klass == "not_sent":
                    result.not_sent_why[(error or "")[:60]] += n
        unpaid: Counter[str] = Counter()
        for status, created, updated in rows:
            if status != "succeeded":
                unpaid[status] += 1
            elif (updated - created).total_seconds() > DEADLINE_S:
                result.over_deadline += 1
        for status, n in unpaid.items():
            result.scale.violations.append(f"{n} payable intent(s) ended {status}")
        if result.over_deadline:
            result.scale.violations.append(f"{result.over_deadline} succeeded after the {DEADLINE_S}s deadline")
    return result
