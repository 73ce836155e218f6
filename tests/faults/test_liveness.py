"""Liveness at scale under faults (issue 14), at half the benchmark's size: 5,000 intents, a provider failing ~45%
of first requests (resets, 504s and truncated bodies after commit, 4 s stalls past the read
timeout, 503 / 429 with Retry-After, 500s), a broker SIGKILL, a dispatch worker SIGKILL, a
PostgreSQL restart, an 8 s provider outage and a frozen worker, all in one run. Every intent must
succeed within its 120 s deadline and its 5-attempt budget, with one effect each at the provider,
every state true, and the broker never holding more than twice the due operations (the most due
in the last second, plus a small slack). Every process fault is placed by progress (10% to 70%
settled), so each still lands while thousands of intents are in flight; what the full size adds
is only a longer run of the same. The scenario and its checks live in ``tests/loads/liveness.py``; the
benchmark (``python -m bench.liveness``) runs it at 10,000 with a clean twin for the throughput ratio.
"""

from __future__ import annotations

import pytest

from outbox.ledger.db import make_engine, make_sessionmaker
from tests.harness import own_pg_ledger
from tests.loads.liveness import QUEUE_SLACK, run_liveness

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

INTENTS = 5_000


def test_five_thousand_intents_settle_under_faults(redis_url, sandbox, tmp_path):
    # redis_url: only so that a missing Redis skips (laptop) or fails (CI); the broker here is private.
    # The ledger's PostgreSQL is the test's own: its restart must not cut the other tests of the run.
    with own_pg_ledger() as (url, cluster):
        engine = make_engine(url)
        try:
            result = run_liveness(
                db_url=url,
                sessions=make_sessionmaker(engine),
                sandbox=sandbox,
                tmp=tmp_path,
                intents=INTENTS,
                seed=7,
                quiet_within_s=300,
                restart_db=lambda: (cluster.stop(), cluster.start()),
            )
        finally:
            engine.dispose()
    s = result.scale
    print(result.summary())
    assert s.redis_restarts == s.worker_kills == s.worker_freezes == result.pg_restarts == result.outages == 1, (
        "\n".join([result.summary(), *s.violations[:10]])
    )
    assert sum(s.faults_fired.values()) > INTENTS // 4, s.faults_fired  # ~45% of first requests
    assert s.violations == [], "\n".join([result.summary(), *s.violations[:30]])
    assert s.statuses["succeeded"] == INTENTS and s.duplicates == 0 and s.lost == 0
    assert result.over_deadline == 0
    worst = max(result.samples, key=lambda x: (x.queued or 0) - 2 * x.due)
    assert result.queue_over == 0, f"{worst.queued} doorbells queued for {worst.due} due (+{QUEUE_SLACK} slack)"
