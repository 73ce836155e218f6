"""The reconciler under a steady load: its backlog stays bounded and nobody gets its work.

A burst settles before a reconciler's backlog shows; a steady rate for minutes shows whether it
keeps up. Here: intents at a steady rate for 45 s under the provider's first-request fault mix
(resets, 504s, stalls and truncated bodies after commit, 503/429, 500), its after-commit share
doubled (~60% of first requests end outcome_unknown) and every lookup taking 100 ms at the
sandbox (a real provider's search, not the sandbox's ~2 ms), a dispatch worker SIGKILLed once (its
claims expire into outcome_unknown), and ONE reconciler as docs/how-to/deploy.md starts it
(``celery -A workers worker -Q outcome_unknown -c 1``). A reconciler that looks up one operation
at a time manages ~9 lookups/s there against ~24/s arriving: its backlog and the oldest
operation's age grow for the whole run (by ~15 operations and ~1 s of age a second, so thirds of
15 s already differ several times over), and operations whose 30 s deadline passes while they
wait for a lookup go to a person. Asserted: the backlog and its oldest age in the last third of the run
no higher than in the first (within a small margin), no handoff at all (every retry succeeds in
this mix), no duplicate effect, and every state true against the sandbox's effects. The scenario
lives in ``tests/loads/reconcile_soak.py``; the soak for minutes belongs there (``python -m
bench.reconcile_soak --rate 40 --duration 90 --ambiguous-scale 2 --lookup-latency-ms 100
--deadline 30 --kill-every 40`` is this test's earlier 90 s form, with a second kill at 80 s).
"""

from __future__ import annotations

import pytest

from tests.loads.reconcile_soak import AFTER_COMMIT, run_soak

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

RATE = 40.0  # intents per second
DURATION_S = 45.0
DEADLINE_S = 30.0  # short enough that a backlog of lookups spends it within the run


def test_a_steady_load_keeps_the_reconcilers_backlog_bounded(pg_ledger, redis_url, sandbox, tmp_path):
    # redis_url: only so that a missing Redis skips (laptop) or fails (CI); the broker here is private.
    result = run_soak(
        db_url=pg_ledger.url,
        sessions=pg_ledger.sessions,
        sandbox=sandbox,
        tmp=tmp_path,
        rate=RATE,
        duration_s=DURATION_S,
        seed=11,
        ambiguous_scale=2.0,
        lookup_latency_ms=100.0,
        deadline_s=DEADLINE_S,
        reconcilers=1,
        concurrency=1,
        # In the middle third (15-30 s): its claims' leases (8 s) expire and are looked up before
        # the last third begins, so they weigh on neither end.
        kill_at_s=(16.0,),
        drain_within_s=60.0,
    )
    print(result.summary())
    (first, last), (oldest_first, oldest_last) = result.backlog_thirds, result.oldest_thirds
    assert last <= 1.5 * first + 20, f"the outcome_unknown backlog grew: {first:.0f} -> {last:.0f}"
    assert oldest_last <= oldest_first + 5.0, f"the oldest unknown aged: {oldest_first:.1f}s -> {oldest_last:.1f}s"
    assert result.drain_s is not None and result.drain_s < 15.0, result.drain_s
    assert result.deadline_handoffs == 0 and not result.handoffs, dict(result.handoffs)
    assert result.scale.violations == [], "\n".join([result.summary(), *result.scale.violations[:30]])
    assert result.scale.statuses == {"succeeded": result.scale.intents} and result.scale.duplicates == 0
    assert result.worker_kills == 1 and result.scale.intents == int(RATE * DURATION_S)
    ambiguous = sum(n for mode, n in result.scale.faults_fired.items() if mode in AFTER_COMMIT)
    assert ambiguous > 0.4 * result.scale.intents, result.scale.faults_fired  # the reconciler was kept busy
