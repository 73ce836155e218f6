"""A worker dies with a batch of completions pending: the provider answered every call of it, and
none is written in the ledger.

A worker's calls answer into one committer thread, which writes whatever has arrived (a doorbell's
whole lane, several doorbells' together) in one transaction. The crash window is the time results
wait there; it lies inside the operations' leases. Here the worker dies (``os._exit``, as after a
SIGKILL) at its first commit, holding a whole doorbell's answers. What must hold, counted at the
sandbox: every operation ends ``succeeded`` with the one object the provider made under its key,
nothing is made twice, nothing ends in a state the provider contradicts.

Real Celery worker processes, the relay, PostgreSQL, Redis and the sandbox over HTTP.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter

import pytest

from outbox.reads.report import state_contradictions
from tests.harness import CLOCK_LEASE, FAST_LOOKUPS, REFUND_ARGS, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

N = 30  # a doorbell of twenty and one of ten (the default doorbell_batch: 20)


def test_a_worker_killed_with_completions_pending_loses_and_doubles_nothing(pipe, sandbox):
    pipe.env.update(CLOCK_LEASE)  # leases of 60 s: they run out only when the ledger's clock is moved
    keys = [f"pending-{i:02d}" for i in range(N)]
    ops = {key: pipe.submit(key, dict(REFUND_ARGS, order_id=f"o-{i}")).operation_id for i, key in enumerate(keys)}
    doomed = pipe.start_worker(
        "doomed", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": "dispatch.after_response=exit@*"}
    )
    pipe.start_relay()
    wait_for(lambda: doomed.proc.poll() is not None, 20, what="the doomed worker dies at its first commit")

    # What it held: calls the provider answered (objects made), none written in the ledger.
    made = Counter(e["idempotency_key"] for e in sandbox.effects())
    statuses = pipe.statuses(list(ops.values()))
    assert statuses is not None
    pending = [key for key in keys if made[pk(key)] and statuses[ops[key]] == "dispatching"]
    # Usually a doorbell's twenty (or its ten, or both doorbells' thirty); one when the watchdog handed a slow lane's
    # claims to threads of their own (a loaded machine) and the first result was committed alone.
    assert pending, f"the worker died with no completion pending: {made}, {statuses}"
    assert "succeeded" not in statuses.values()

    pipe.start_worker("w1", queues="dispatch,outcome_unknown", extra_env=FAST_LOOKUPS)
    pipe.advance_ledger_clock(pipe.lease_s + 1)  # the leases of what it held run out
    wait_for(
        lambda: Counter((pipe.statuses(list(ops.values())) or {}).values()) == Counter({"succeeded": N}),
        60,
        what=lambda: f"all succeeded (now {Counter((pipe.statuses(list(ops.values())) or {}).values())})",
    )
    for key, op_id in ops.items():
        effects = sandbox.effects(key=pk(key))
        assert len(effects) == 1, (key, effects)  # one object per key, the pending ones included
        assert pipe.op(op_id).result_reference == effects[0]["object_id"], key
    assert sandbox.duplicates() == []
    with pipe.sessions() as s:
        assert state_contradictions(s, since=dt.datetime(2000, 1, 1, tzinfo=dt.UTC)) == []
    print(f"{len(pending)} completions pending at the kill; {len(sandbox.effects())} objects for {N} intents")
