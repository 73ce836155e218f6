"""Scale-out proof: many intents, several workers, a seeded fault mix, a broker restart and a
worker SIGKILL mid-run; then FAULTS.md's invariants, counted at the sandbox and in the ledger.

One implementation, two sizes: ``run_scale_proof`` is used by ``python -m bench.scale_proof`` (default 3000 intents)
and by ``tests/faults/test_scale_proof.py`` (300 intents, CI-sized).

Set-up of one run:

- PostgreSQL: a throwaway database (``bench/scratch_database.py``) here, the test's ``pg_ledger``
  in the test;
- a PRIVATE redis-server (``tests.harness.PrivateRedis``, no persistence) as broker and breaker
  store (``OUTBOX_BROKER_URL`` and ``OUTBOX_REDIS_URL``); the shared Redis on 6379 is never touched;
- the sandbox provider with probability rules drawn from the seed (503 + Retry-After 1, 429 +
  Retry-After 1, commit_then_drop, commit_then_502, truncated_body, drop_before_commit, a few
  reject_422) on every POST;
- W solo worker processes on the ``dispatch`` queue, one reconciler worker on ``outcome_unknown``,
  the relay in a thread (``tests.harness.Pipeline``);
- N intents submitted in a burst (100 per transaction) over three actions (refunds, tickets,
  emails) while everything runs.

Mid-run (by progress, so it happens while work is in flight): when a quarter of the intents is
settled the private Redis is SIGKILLed and restarted empty on the same port; at half, one
dispatch worker (seeded choice) is SIGKILLed and a replacement is started; at three quarters,
another is frozen (SIGSTOP) for FREEZE_S, past its lease, so its operations are looked up and
sent again by others, and then thawed (SIGCONT): whatever it was about to send or write arrives late.

Quiet = no operation in ``not_dispatched``, ``dispatching``, ``outcome_unknown``,
``awaiting_approval`` or ``committed_evidence_degraded`` (``outcome_unknown`` being reconciled is
not quiet; ``reconciliation_required`` is parked and counts as quiet).

Invariants checked once quiet (each failure is one violation, described in ``violations``):

- I1 zero duplicate effects (sandbox ``/admin/duplicates?by=key``; also per key from the effects);
- I2 zero lost intents: every submitted operation id exists, the count matches, every status is a
  ``Status``, and nothing is left un-quiet at the deadline;
- I3 ``succeeded`` has exactly one effect with its key and ``result_reference`` = that effect's
  object id; ``failed_before_commit`` has none; the ledger's own report finds no operation whose
  attempts contradict its state (``outbox.report.state_contradictions``);
- I5 every operation has a reason and an attempt history; every ``reconciliation_required`` one
  has an open handoff whose packet holds all five items (operation, attempts, last_error,
  next_step, intent), each non-empty;
- I6 at most ``max_attempts`` dispatch attempts sent per operation (ledger) and at most
  ``max_attempts`` POSTs per key (provider); ``attempt_count`` may exceed the cap by one only when
  that last claim found the budget spent and ended the operation without sending (by design,
  ``workers/engine/outcomes.py`` ``before_send``; counted as ``budget_end_claims``).

    .venv/bin/python -m bench.scale_proof [--intents 3000] [--seed 7] [--workers 4] [--quick]

Prints one summary line (and the violations, if any), writes the figures as JSON to
bench/results/; exits 1 on any violation.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # tests.harness is imported as a namespace package from the root
    sys.path.insert(0, str(ROOT))

MAX_ATTEMPTS = 4
# Longer than the harness's 3 s lease plus the sweep: the frozen worker's claims expire, are
# looked up and re-sent by the others before it wakes up.
FREEZE_S = 6.0
NOT_QUIET = ("not_dispatched", "dispatching", "outcome_unknown", "awaiting_approval", "committed_evidence_degraded")
QUIET_HOLD_S = 3.0  # > the 1 s read timeout of a thawed worker's call, its commit and a sweep
PACKET_ITEMS = ("operation", "attempts", "last_error", "next_step", "intent")

# action -> (sandbox path, sandbox resource name, args for intent i)
ACTIONS: dict[str, tuple[str, str, Any]] = {
    "payments.refund.create": (
        "/v1/refunds",
        "refunds",
        lambda i: {"order_id": f"o-{i}", "amount": f"{1 + i % 90}.50", "currency": "EUR", "reason": "damaged"},
    ),
    "support.ticket.create": (
        "/v1/tickets",
        "tickets",
        lambda i: {"subject": f"ticket {i}", "customer_id": f"c-{i}", "priority": "normal"},
    ),
    "notify.email.send": (
        "/v1/emails",
        "emails",
        lambda i: {"to": f"user{i}@example.com", "subject": f"mail {i}", "body": "hello"},
    ),
}


def fault_mix(seed: int, *, stall: float = 0.0) -> list[dict[str, Any]]:
    """The seeded fault rules (first match wins; each rule draws from its own Random(seed + n)).

    ``stall``: the share of calls that commit and then answer only after 2 s, past the target's
    1 s read timeout (ambiguous: the reconciler finds the effect), so a slow call sits in a batch.
    """
    rules = [
        {"mode": "unavailable_503", "probability": 0.05, "retry_after_s": 1},
        {"mode": "rate_limited_429", "probability": 0.05, "retry_after_s": 1},
        {"mode": "commit_then_drop", "probability": 0.03},
        {"mode": "commit_then_502", "probability": 0.03},
        {"mode": "truncated_body", "probability": 0.02},
        {"mode": "drop_before_commit", "probability": 0.04},
        {"mode": "reject_422", "probability": 0.01},
    ]
    if stall:
        rules.append({"mode": "commit_then_stall", "probability": stall, "stall_s": 2.0})
    return [dict(r, method="POST", path="/v1/*", seed=seed * 100 + n) for n, r in enumerate(rules)]


def scale_actions_doc(sandbox_url: str, *, fencing: bool = False) -> dict[str, Any]:
    """``fencing``: the actions declare provider_fencing (the sandbox then runs strict fencing)."""
    from tests.harness import action, actions_doc

    budget = {"max_attempts": MAX_ATTEMPTS, "deadline_s": 600, "base_delay_s": 0.1, "max_delay_s": 1}
    extra = {"provider_fencing": True} if fencing else {}
    actions = {
        name: action(path, budget=budget, **extra, **({"decimal_args": ["amount"]} if "refund" in name else {}))
        for name, (path, _, _) in ACTIONS.items()
    }
    return actions_doc(sandbox_url, actions=actions)


@dataclass
class ScaleResult:
    seed: int
    intents: int
    workers: int
    fencing: bool = False
    wall_s: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)
    reconciled: int = 0  # operations that went through outcome_unknown
    retries: int = 0  # dispatch attempts beyond the first per operation
    effects: int = 0
    duplicates: int = 0
    lost: int = 0
    redis_restarts: int = 0
    worker_kills: int = 0
    worker_freezes: int = 0
    faults_fired: dict[str, int] = field(default_factory=dict)
    # Why operations went to a person (the reason up to its first ':', counted).
    handoff_reasons: Counter[str] = field(default_factory=Counter)
    budget_end_claims: int = 0  # claims past the cap that ended the operation without sending
    violations: list[str] = field(default_factory=list)

    @property
    def ops_per_s(self) -> float:
        return self.intents / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        s = self.statuses
        return (
            f"scale-proof seed={self.seed} intents={self.intents} workers={self.workers} "
            f"fencing={'yes' if self.fencing else 'no'} "
            f"wall={self.wall_s:.1f}s ops/s={self.ops_per_s:.1f} succeeded={s['succeeded']} "
            f"failed_before_commit={s['failed_before_commit']} "
            f"reconciliation_required={s['reconciliation_required']} reconciled={self.reconciled} "
            f"retries={self.retries} effects={self.effects} duplicates={self.duplicates} lost={self.lost} "
            f"redis_restarts={self.redis_restarts} worker_kills={self.worker_kills} "
            f"worker_freezes={self.worker_freezes} violations={len(self.violations)}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "intents": self.intents,
            "workers": self.workers,
            "fencing": self.fencing,
            "wall_s": self.wall_s,
            "handoff_reasons": dict(self.handoff_reasons),
            "ops_per_s": self.ops_per_s,
            "statuses": dict(self.statuses),
            "reconciled": self.reconciled,
            "retries": self.retries,
            "effects": self.effects,
            "duplicates": self.duplicates,
            "lost": self.lost,
            "redis_restarts": self.redis_restarts,
            "worker_kills": self.worker_kills,
            "worker_freezes": self.worker_freezes,
            "faults_fired": self.faults_fired,
            "budget_end_claims": self.budget_end_claims,
            "violations": self.violations,
        }


def _status_counts(sessions: sessionmaker[Session]) -> Counter[str]:
    from outbox.ledger.models import Operation

    with sessions() as s:
        return Counter(
            {st: n for st, n in s.execute(select(Operation.status, func.count()).group_by(Operation.status)).all()}
        )


def _unapplied_late_successes(sessions: sessionmaker[Session]) -> int:
    """Late successes recorded and not yet applied (the relay's sweep applies them)."""
    from outbox.ledger.models import UNAPPLIED_SUCCESS, Attempt

    with sessions() as s:
        return int(s.execute(select(func.count()).select_from(Attempt).where(text(UNAPPLIED_SUCCESS))).scalar_one())


@dataclass
class QuietHold:
    """Quiet is a state that holds: no operation busy and no late success unapplied for QUIET_HOLD_S
    on end. Breaking at the first quiet reading after a thaw checked a ledger that the thawed
    worker's answer (1 s read timeout) was about to change: a CI run found a late success written
    between the check's two reads."""

    since: float | None = None
    began: float | None = None  # when the quiet that held began (None: it never held)

    def held(self, sessions: sessionmaker[Session], *, busy: int, now: float) -> bool:
        try:
            unquiet = busy or _unapplied_late_successes(sessions)
        except Exception:  # noqa: BLE001 - the ledger is restarting: not quiet yet
            unquiet = True
        if unquiet:
            self.since = None
            return False
        self.since = now if self.since is None else self.since
        if now - self.since < QUIET_HOLD_S:
            return False
        self.began = self.since
        return True


def _log(msg: str, verbose: bool) -> None:
    if verbose:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def private_broker_pipeline(
    *, db_url: str, sessions: sessionmaker[Session], sandbox: Any, tmp: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[Any, Any]]:
    """The harness pipeline with a PRIVATE redis-server as broker and breaker store (so a run can
    SIGKILL it); yields (pipeline, redis) and kills the redis-server at the end."""
    from tests.harness import PrivateRedis, pipeline

    redis = PrivateRedis(tmp).start()
    try:
        with pipeline(
            db_url=db_url,
            sessions=sessions,
            redis_url=redis.url,
            tmp=tmp,
            sandbox_url=sandbox.url,
            env={"OUTBOX_BROKER_URL": redis.url, "OUTBOX_REDIS_URL": redis.url} | (env or {}),
        ) as pipe:
            yield pipe, redis
    finally:
        redis.kill()


# How long a submit batch is retried while the ledger is away (a PostgreSQL restart takes seconds).
SUBMIT_RETRY_S = 60.0


class SubmitThread:
    """Intents submitted by a thread of their own (a subclass's ``_run(started)``), so faults land
    while intents still arrive."""

    sessions: sessionmaker[Session]
    key_prefix: str
    subject: str
    keys: dict[str, tuple[str, str]]  # op id -> (action, provider key)
    thread: threading.Thread | None
    thread_name = "submit"

    def _run(self, started: float) -> None:
        raise NotImplementedError

    def start(self) -> float:
        """Start submitting; returns the monotonic start time."""
        started = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(started,), name=self.thread_name, daemon=True)
        self.thread.start()
        return started

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)

    def _submit_batch(self, first: int, end: int) -> None:
        """One transaction of intents, as an agent's producer would submit it: a ledger that goes
        away mid-transaction (the PostgreSQL restart fault) is retried with the SAME keys, which is
        safe (same key + same arguments = the same operation); receipts count only once committed.
        Any SQLAlchemy error is such a loss: besides the driver's (DBAPIError), a connection cut
        while the transaction closes surfaces as InvalidRequestError/PendingRollbackError (a run of
        the liveness test whose restart landed mid-submit ended its submitter on one)."""
        from sqlalchemy.exc import SQLAlchemyError

        from producer import submit

        names = list(ACTIONS)
        deadline = time.monotonic() + SUBMIT_RETRY_S
        while True:
            receipts: dict[str, tuple[str, str]] = {}
            try:
                with self.sessions.begin() as s:
                    for i in range(first, end):
                        name = names[i % len(names)]
                        key = f"{self.key_prefix}-{i:06d}"
                        r = submit(
                            s,
                            tenant="t1",
                            idempotency_key=key,
                            action=name,
                            args=ACTIONS[name][2](i),
                            subject=self.subject,
                        )
                        receipts[r.operation_id] = (name, r.provider_key or key)
            except SQLAlchemyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
                continue
            self.keys.update(receipts)
            return


@dataclass
class Burst(SubmitThread):
    """N intents over ACTIONS, 100 per transaction, submitted by a thread of their own."""

    sessions: sessionmaker[Session]
    intents: int
    key_prefix: str
    subject: str
    verbose: bool = False
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # op id -> (action, provider key)
    errors: list[BaseException] = field(default_factory=list)
    thread: threading.Thread | None = None
    thread_name = "burst-submit"

    def _run(self, started: float) -> None:
        try:
            for first in range(0, self.intents, 100):
                self._submit_batch(first, min(first + 100, self.intents))
            _log(f"submitted {self.intents} in {time.monotonic() - started:.1f}s", self.verbose)
        except BaseException as exc:  # noqa: BLE001 - reported as a violation by the caller
            self.errors.append(exc)


def run_scale_proof(
    *,
    db_url: str,
    sessions: sessionmaker[Session],
    sandbox: Any,
    tmp: Path,
    intents: int = 300,
    seed: int = 7,
    workers: int = 4,
    deadline_s: float | None = None,
    verbose: bool = False,
    fencing: bool = False,
    stall: float = 0.0,
) -> ScaleResult:
    """Run the scenario against an EMPTY migrated ledger (``db_url``/``sessions``) and a sandbox
    (``SandboxServer``/``SandboxProcess``, reset here). Returns figures and violations.

    ``fencing``: the sandbox refuses older fencing tokens and the actions declare provider_fencing,
    so a lookup's "not found" proves earlier attempts unable to land (fewer handoffs)."""

    result = ScaleResult(seed=seed, intents=intents, workers=workers, fencing=fencing)
    rng = random.Random(seed)
    deadline_s = deadline_s if deadline_s is not None else 180.0 + intents * 0.3
    sandbox.reset()
    sandbox.configure(request_log_max=max(100_000, intents * 20), strict_fencing=fencing)
    for rule in fault_mix(seed, stall=stall):
        sandbox.add_fault(**rule)

    with private_broker_pipeline(db_url=db_url, sessions=sessions, sandbox=sandbox, tmp=tmp) as (pipe, redis):
        pipe.write_actions(scale_actions_doc(sandbox.url, fencing=fencing))
        dispatchers = [pipe.start_worker(f"d{i + 1}", queues="dispatch") for i in range(workers)]
        pipe.start_worker("reconciler", queues="outcome_unknown")
        pipe.start_relay()

        killed: list[Any] = []
        # In a thread, so the faults below land while intents still arrive.
        submitter = Burst(sessions, intents, key_prefix=f"scale-{seed}", subject="scale-proof", verbose=verbose)
        keys = submitter.keys  # operation id -> (action, key)
        started = submitter.start()
        deadline = started + deadline_s
        last_print = 0.0
        frozen: Any | None = None
        thaw_at = 0.0
        quiet = QuietHold()
        while True:
            counts = _status_counts(sessions)
            busy = sum(counts[st] for st in NOT_QUIET)
            settled = sum(counts.values()) - busy
            now = time.monotonic()
            if result.redis_restarts == 0 and settled >= intents // 4:
                _log(f"SIGKILL private redis at {settled}/{intents} settled", verbose)
                redis.kill()
                time.sleep(1.0)
                redis.start()  # same port, empty
                result.redis_restarts += 1
            elif result.redis_restarts and result.worker_kills == 0 and settled >= intents // 2:
                victim = dispatchers.pop(rng.randrange(len(dispatchers)))
                _log(f"SIGKILL worker {victim.name} (pid {victim.pid}) at {settled}/{intents} settled", verbose)
                victim.kill()
                killed.append(victim)
                result.worker_kills += 1
                dispatchers.append(pipe.start_worker(f"d{workers + result.worker_kills}", queues="dispatch"))
            elif result.worker_kills and result.worker_freezes == 0 and settled >= intents * 3 // 4:
                frozen = dispatchers[rng.randrange(len(dispatchers))]
                _log(
                    f"SIGSTOP worker {frozen.name} (pid {frozen.pid}) for {FREEZE_S:g}s at {settled}/{intents} settled",
                    verbose,
                )
                frozen.freeze()
                thaw_at = now + FREEZE_S
                result.worker_freezes += 1
            if frozen is not None and now >= thaw_at:
                _log(f"SIGCONT worker {frozen.name}", verbose)
                frozen.thaw()
                frozen = None
            done = not submitter.is_alive() and result.worker_freezes and frozen is None
            if quiet.held(sessions, busy=busy if done else 1, now=now):
                break
            if now > deadline:
                result.violations.append(f"I2: not quiet after {deadline_s:.0f}s: {dict(counts)}")
                break
            if verbose and now - last_print > 10:
                last_print = now
                _log(f"{dict(counts)}", verbose)
            time.sleep(0.1)
        result.wall_s = (quiet.began or time.monotonic()) - started  # to when the quiet that held began
        submitter.join(30)
        if submitter.errors:
            result.violations.append(f"submit failed: {submitter.errors[0]!r}")
        for w in pipe.workers:  # a worker that died on its own is worth knowing about
            if w not in killed and w.proc.poll() is not None:
                result.violations.append(f"worker {w.name} exited on its own (rc {w.proc.returncode})")
        _check(result, sessions, sandbox, keys)
    return result


def _check(
    result: ScaleResult,
    sessions: sessionmaker[Session],
    sandbox: Any,
    keys: dict[str, tuple[str, str]],
    *,
    max_attempts: int = MAX_ATTEMPTS,
) -> None:
    from outbox.ledger.history import HistoryEvent
    from outbox.ledger.models import Attempt, Handoff, Operation
    from outbox.ledger.states import Status
    from outbox.reads.report import state_contradictions

    v = result.violations
    valid = {s.value for s in Status}
    resource_of = {name: res for name, (_, res, _) in ACTIONS.items()}
    path_of = {name: path for name, (path, _, _) in ACTIONS.items()}

    effects = sandbox.effects()
    result.effects = len(effects)
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in effects:
        by_key[(e["resource"], e["idempotency_key"])].append(e)
    dups = sandbox.duplicates(by="key")
    result.duplicates = len(dups) + sum(1 for lst in by_key.values() if len(lst) > 1 and not dups)
    for d in dups:
        v.append(f"I1: duplicate effects {json.dumps(d)[:300]}")
    posts: Counter[tuple[str, str | None]] = Counter(
        (r["path"], r["idempotency_key"]) for r in sandbox.requests(method="POST")
    )

    # A session of its own: in the one below, the attempts it shows would be those already loaded
    # (the identity map), not the rows its query matched.
    with sessions() as s:
        contradictions = state_contradictions(s, since=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    with sessions() as s:
        ops = {op.id: op for op in s.execute(select(Operation)).scalars()}
        attempts: dict[str, list[Attempt]] = defaultdict(list)
        for a in s.execute(select(Attempt).order_by(Attempt.id)).scalars():
            attempts[a.operation_id].append(a)
        handoffs: dict[str, list[Handoff]] = defaultdict(list)
        for h in s.execute(select(Handoff)).scalars():
            handoffs[h.operation_id].append(h)
        result.reconciled = int(
            s.execute(
                select(func.count(func.distinct(HistoryEvent.operation_id))).where(
                    HistoryEvent.to_status == Status.OUTCOME_UNKNOWN.value
                )
            ).scalar_one()
        )
    for c in contradictions[:20]:
        v.append(
            f"I3: {c['operation_id']} key={c['idempotency_key']} status={c['status']}: {c['why']} "
            f"(attempt {c['attempt']})"
        )

    result.statuses = Counter(op.status for op in ops.values())
    missing = [op_id for op_id in keys if op_id not in ops]
    result.lost = len(missing)
    for op_id in missing[:20]:
        v.append(f"I2: submitted operation {op_id} ({keys[op_id]}) does not exist")
    if len(ops) != len(keys):
        v.append(f"I2: {len(ops)} operations in the ledger, {len(keys)} submitted")
    dispatch_rows = 0
    for op_id, (name, key) in keys.items():
        op = ops.get(op_id)
        if op is None:
            continue
        mine = by_key.get((resource_of[name], key), [])
        tag = f"{op_id} key={key} status={op.status}"
        if op.status not in valid:
            v.append(f"I2: {tag}: not a Status")
        if op.status in NOT_QUIET:
            v.append(f"I2: {tag}: not settled ({op.reason})")
        if op.status == Status.SUCCEEDED.value:
            if len(mine) != 1:
                v.append(f"I3: {tag}: succeeded with {len(mine)} effects")
            elif op.result_reference != mine[0]["object_id"]:
                v.append(f"I3: {tag}: result_reference {op.result_reference} != effect {mine[0]['object_id']}")
        if op.status == Status.FAILED_BEFORE_COMMIT.value and mine:
            v.append(f"I3: {tag}: failed_before_commit but {len(mine)} effect(s) {[e['object_id'] for e in mine]}")
        if not op.reason:
            v.append(f"I5: {tag}: no reason")
        dispatches = [a for a in attempts[op_id] if a.kind == "dispatch"]
        dispatch_rows += len(dispatches)
        if not dispatches:
            v.append(f"I5: {tag}: no dispatch attempt recorded")
        if op.status == Status.RECONCILIATION_REQUIRED.value:
            result.handoff_reasons[(op.reason or "").split(":")[0][:80]] += 1
            open_ = [h for h in handoffs[op_id] if h.status == "open"]
            if not open_:
                v.append(f"I5: {tag}: parked without an open handoff")
            for h in open_:
                packet = h.packet or {}
                absent = [item for item in PACKET_ITEMS if not packet.get(item)]
                if absent:
                    v.append(f"I5: {tag}: handoff {h.id} packet lacks {absent}")
        cap = max_attempts if op.max_attempts is None else min(max_attempts, op.max_attempts)
        # Sent = reached (or may have reached) the provider; a claim that found the budget spent
        # records a not_sent attempt and ends the operation without sending (workers/reconcile/batch.py
        # _cap_redispatch: "the next claim ends it failed_before_commit"), so attempt_count may
        # read max_attempts + 1 in exactly that case.
        sent_rows = [a for a in dispatches if a.attempt_class != "not_sent"]
        if len(sent_rows) > cap:
            v.append(f"I6: {tag}: {len(sent_rows)} dispatch attempts sent > max_attempts {cap}")
        if op.attempt_count > cap:
            last = dispatches[-1] if dispatches else None
            if op.attempt_count == cap + 1 and last is not None and last.attempt_class == "not_sent":
                result.budget_end_claims += 1
            else:
                v.append(f"I6: {tag}: attempt_count {op.attempt_count} > max_attempts {cap}")
        sent = posts[(path_of[name], key)]
        if sent > cap:
            v.append(f"I6: {tag}: the provider saw {sent} POSTs > max_attempts {cap}")
    result.retries = dispatch_rows - sum(1 for op_id in keys if attempts.get(op_id))
    result.faults_fired = {f"{r['mode']}": r["fired"] for r in sandbox.faults()}
