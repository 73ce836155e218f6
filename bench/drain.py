"""Drain a backlog with N worker processes: through the ledger, or with a bare SKIP LOCKED loop.

Both loops commit twice per operation: once for the claim, once for the finalize (the dispatch
between them is left out: its cost is the downstream's, not the ledger's).

- ledger: ``claim_due`` in one transaction, ``finalize_if_fenced(..., to=succeeded)`` in another,
  through SQLAlchemy sessions exactly as a worker does; each claim also writes an attempt row, and
  each finalize writes the attempt's result (on PostgreSQL both events are recorded on the attempt
  row since migration 0015; SQLite writes an event row each).
- bare: the same two UPDATEs on ``bare_operations`` with psycopg, no ORM, no evidence rows.
- bare_evidence: psycopg running the same statements the ledger sends (claim UPDATE, open-ambiguity
  SELECT, attempt INSERT, event INSERT; attempt UPDATE, fenced UPDATE, event INSERT: the statements
  as they were before the events moved onto attempt rows, 9 writes per operation) on the
  ledger's own tables, without SQLAlchemy: it splits the ledger's gap to ``bare`` into the cost of
  its SQL (evidence rows, round trips) and the cost of building statements in Python.

Workers are spawned processes (no shared connections or interpreter state); they connect and
warm up first, wait on a barrier, then drain until a claim returns nothing. Throughput is the total
count over the span from the earliest start to the latest finish (CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from dataclasses import dataclass
from typing import Any

from outbox.ledger.models import ATTEMPTS, OPERATION_EVENTS, OPERATIONS

LEASE_S = 60.0  # far longer than any one claim->finalize here: no lease ever expires mid-run
RESULT_TIMEOUT_S = 600.0  # a stuck worker fails the run instead of hanging it

BARE_CLAIM = """
WITH due AS (
    SELECT id FROM bare_operations
    WHERE status = 'not_dispatched' AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE bare_operations o
SET status = 'dispatching', fencing_token = o.fencing_token + 1, lease_owner = %(worker)s,
    lease_expires_at = now() + interval '60 seconds', attempt_count = o.attempt_count + 1,
    reason = 'claimed', updated_at = now()
FROM due WHERE o.id = due.id
RETURNING o.id, o.fencing_token
"""

BARE_FINALIZE = """
UPDATE bare_operations
SET status = 'succeeded', result_reference = 're_x', lease_owner = NULL, lease_expires_at = NULL,
    reason = 'bench', updated_at = now(), finished_at = now()
WHERE id = %(id)s AND status = 'dispatching' AND fencing_token = %(token)s
"""


EVIDENCE_CLAIM = f"""
WITH due AS (
    SELECT id FROM {OPERATIONS}
    WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp()
    ORDER BY next_attempt_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {OPERATIONS} o
SET status = 'dispatching', reason = 'claimed', fencing_token = o.fencing_token + 1,
    lease_owner = %(worker)s, lease_expires_at = clock_timestamp() + make_interval(secs => 60.0),
    attempt_count = o.attempt_count + 1, updated_at = clock_timestamp()
FROM due WHERE o.id = due.id
RETURNING o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.action, o.args,
          o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at,
          o.created_at, o.cancel_requested, o.proven_absent_through
"""
EVIDENCE_AMBIGUITY = f"""
SELECT EXISTS (SELECT * FROM {ATTEMPTS} WHERE operation_id = %(id)s AND kind = 'dispatch'
               AND attempt_number > %(through)s AND attempt_class IN ('ambiguous', 'pending'))
"""
EVIDENCE_ATTEMPT = f"""
INSERT INTO {ATTEMPTS} (operation_id, attempt_number, kind, fencing_token, worker, started_at,
                      attempt_class, stale)
VALUES (%(id)s, %(number)s, 'dispatch', %(token)s, %(worker)s, clock_timestamp(), 'pending', false)
RETURNING id
"""
EVIDENCE_EVENT = f"""
INSERT INTO {OPERATION_EVENTS} (operation_id, at, from_status, to_status, fencing_token, event,
                              reason, actor)
VALUES (%(id)s, clock_timestamp(), %(src)s, %(dst)s, %(token)s, %(event)s, %(reason)s, %(worker)s)
"""
EVIDENCE_RECORD = f"""
UPDATE {ATTEMPTS} SET ended_at = clock_timestamp(), attempt_class = 'succeeded', status_code = 200,
    provider_reference = 're_x', stale = false
WHERE id = %(attempt)s AND ended_at IS NULL RETURNING id
"""
EVIDENCE_FINALIZE = f"""
UPDATE {OPERATIONS} SET status = 'succeeded', reason = 'bench', lease_owner = NULL,
    lease_expires_at = NULL, result_reference = 're_x', result_digest = NULL, result = 'null',
    error_class = NULL, updated_at = clock_timestamp(), finished_at = clock_timestamp()
WHERE id = %(id)s AND status IN ('dispatching') AND fencing_token = %(token)s
RETURNING fencing_token
"""


@dataclass(frozen=True)
class DrainResult:
    loop: str  # "ledger", "bare" or "bare_evidence"
    processes: int
    claim_limit: int
    pre_ping: bool
    ops: int
    seconds: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


def _ledger_worker(
    url: str, worker: str, claim_limit: int, pre_ping: bool, barrier: Any, results: Any, loop: str = "ledger"
) -> None:

    from outbox.ledger.claims import claim_due
    from outbox.ledger.db import make_engine, make_sessionmaker
    from outbox.ledger.hot_path import LedgerConnection
    from outbox.ledger.states import AttemptClass, Status
    from outbox.ledger.transitions import AttemptReport, finalize_if_fenced

    engine = make_engine(url, pool_size=1, max_overflow=1, pool_pre_ping=pre_ping)
    report = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_x")
    if loop == "ledger (sessions)":
        sessions = make_sessionmaker(engine)
        claim_tx, finalize_tx = sessions.begin, sessions.begin
    else:  # what a worker does (workers/dispatch/batch.py): its own connection, one statement each
        ledger = LedgerConnection(engine)
        claim_tx, finalize_tx = ledger.one_statement, ledger.one_statement
    with claim_tx() as s:  # connect outside the measured span
        claim_due(s, worker=worker, lease_s=LEASE_S, operation_id="warm-up")
    barrier.wait()
    started, done = time.monotonic(), 0
    while True:
        with claim_tx() as s:
            claims = claim_due(s, worker=worker, lease_s=LEASE_S, limit=claim_limit)
        if not claims:
            break
        for claim in claims:
            with finalize_tx() as s:
                finalize_if_fenced(s, claim, report, to=Status.SUCCEEDED, reason="bench")
        done += len(claims)
    results.put((done, started, time.monotonic()))
    engine.dispose()


def _bare_worker(
    url: str, worker: str, claim_limit: int, pre_ping: bool, barrier: Any, results: Any, autocommit: bool = False
) -> None:
    import psycopg

    from bench.scratch_database import libpq

    # With autocommit the commit() calls below find no transaction open and send nothing.
    with psycopg.connect(libpq(url), autocommit=autocommit) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        barrier.wait()
        started, done = time.monotonic(), 0
        while True:
            rows = conn.execute(BARE_CLAIM, {"limit": claim_limit, "worker": worker}).fetchall()
            conn.commit()
            if not rows:
                break
            for op_id, token in rows:
                conn.execute(BARE_FINALIZE, {"id": op_id, "token": token})
                conn.commit()
            done += len(rows)
    results.put((done, started, time.monotonic()))


def _ledger_sessions_worker(
    url: str, worker: str, claim_limit: int, pre_ping: bool, barrier: Any, results: Any
) -> None:
    _ledger_worker(url, worker, claim_limit, pre_ping, barrier, results, loop="ledger (sessions)")


def _bare_autocommit_worker(
    url: str, worker: str, claim_limit: int, pre_ping: bool, barrier: Any, results: Any
) -> None:
    """The bare loop with each statement its own transaction (no BEGIN/COMMIT round trips)."""
    _bare_worker(url, worker, claim_limit, pre_ping, barrier, results, autocommit=True)


def _bare_evidence_worker(url: str, worker: str, claim_limit: int, pre_ping: bool, barrier: Any, results: Any) -> None:
    import psycopg

    from bench.scratch_database import libpq

    with psycopg.connect(libpq(url)) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        barrier.wait()
        started, done = time.monotonic(), 0
        while True:
            claims = []
            for row in conn.execute(EVIDENCE_CLAIM, {"limit": claim_limit, "worker": worker}).fetchall():
                op_id, token, number = row[0], row[1], row[2]
                conn.execute(EVIDENCE_AMBIGUITY, {"id": op_id, "through": row[14]}).fetchone()
                (attempt,) = conn.execute(
                    EVIDENCE_ATTEMPT, {"id": op_id, "number": number, "token": token, "worker": worker}
                ).fetchone()  # type: ignore[misc]
                conn.execute(
                    EVIDENCE_EVENT,
                    {
                        "id": op_id,
                        "src": "not_dispatched",
                        "dst": "dispatching",
                        "token": token,
                        "event": "claim",
                        "reason": f"dispatch attempt {number}",
                        "worker": worker,
                    },
                )
                claims.append((op_id, token, attempt))
            conn.commit()
            if not claims:
                break
            for op_id, token, attempt in claims:
                conn.execute(EVIDENCE_RECORD, {"attempt": attempt}).fetchone()
                conn.execute(EVIDENCE_FINALIZE, {"id": op_id, "token": token}).fetchone()
                conn.execute(
                    EVIDENCE_EVENT,
                    {
                        "id": op_id,
                        "src": "dispatching",
                        "dst": "succeeded",
                        "token": token,
                        "event": "attempt result",
                        "reason": "bench",
                        "worker": worker,
                    },
                )
                conn.commit()
            done += len(claims)
    results.put((done, started, time.monotonic()))


def drain(url: str, loop: str, *, processes: int, claim_limit: int = 1, pre_ping: bool = False) -> DrainResult:
    """Run ``processes`` workers of ``loop`` until nothing is due; ``pre_ping`` is the ledger's only."""
    target = {
        "ledger": _ledger_worker,
        "ledger (sessions)": _ledger_sessions_worker,
        "bare": _bare_worker,
        "bare_autocommit": _bare_autocommit_worker,
        "bare_evidence": _bare_evidence_worker,
    }[loop]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=target, name=f"{loop}-{i}", args=(url, f"bench-{loop}-{i}", claim_limit, pre_ping, barrier, results)
        )
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        got: list[tuple[int, float, float]] = []
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(got) < processes:
            try:
                got.append(results.get(timeout=1.0))
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{loop} worker failed: exit codes {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    ops = sum(n for n, _, _ in got)
    span = max(end for _, _, end in got) - min(start for _, start, _ in got)
    return DrainResult(loop, processes, claim_limit, pre_ping and loop == "ledger", ops, span)
