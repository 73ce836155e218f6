"""A soft time limit's signal that arrives after its task has ended (celery#2952).

Celery's parent process sends SIGUSR1 to a pool process when a task's soft limit runs out, unless it
has read the task's result by then. While it reconnects to the broker it reads none, so when it comes
back it sends the signals of tasks that ended meanwhile: to a process that is idle, runs a later
task, or is leaving because Celery cancelled its task on the connection loss (SIGTERM). Billiard's
own handler raises wherever the signal lands: an idle process ended with an ERROR ("Pool process
... error: SoftTimeLimitExceeded()"), a leaving one cut short the drain of its calls out. The CI run
of 2026-12-04 saw both ERRORs in tests/faults/test_broker_outage.py. Here each signal is sent by hand,
the way the parent sends it, to a real prefork worker; the effects are counted at the sandbox.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from outbox.ledger.states import Status
from tests.harness import actions_doc, descendants, log_records, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"


def _alive(pid: int) -> bool:
    """Running, not ended (a zombie waiting for its parent counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pool_process(worker_pid: int) -> int:
    (child,) = descendants(worker_pid)  # concurrency 1
    return child


def test_a_stale_soft_limit_leaves_an_idle_pool_process_at_work(pipe, sandbox):
    w = pipe.start_worker("w1", pool="prefork", concurrency=1)
    pipe.start_relay()
    first = pipe.submit("stale-soft-idle-1").operation_id
    pipe.wait_status(first, Status.SUCCEEDED.value)
    child = _pool_process(w.pid)

    # The signal of the task that has just ended, as the parent sends it after a broker outage.
    os.kill(child, signal.SIGUSR1)
    time.sleep(1.5)  # billiard's handler ended the process at once (then 1 s to exit)
    assert _alive(child), "the pool process ended on a soft limit of a task that had ended"

    second = pipe.submit("stale-soft-idle-2").operation_id
    pipe.wait_status(second, Status.SUCCEEDED.value)
    assert descendants(w.pid) == [child]
    assert sorted(e["idempotency_key"] for e in sandbox.effects()) == sorted(
        pk(k) for k in ("stale-soft-idle-1", "stale-soft-idle-2")
    )
    w.stop()
    log = w.log()
    assert log_records(log, "ERROR", "CRITICAL") == [], log[-3000:]
    assert "soft time limit signal ignored, armed for a task that has ended: " in log


def test_a_pool_process_leaving_on_a_cancel_finalizes_its_call_out_through_a_stale_soft_limit(pipe, sandbox):
    # The call takes 0.8 s: still out when the process is told to leave. The target's timeout is
    # 1.4 s (the default 1 s timed the call out on a loaded machine: an unknown, then a lookup); with
    # the connect timeout it stays under the soft limit of 2 s, as the workers require.
    pipe.write_actions(actions_doc(sandbox.url, timeout_s=1.4))
    sandbox.add_fault(mode="latency", latency_ms=800, method="POST", path=REFUNDS)
    w = pipe.start_worker("w1", pool="prefork", concurrency=1)
    pipe.start_relay()
    op_id = pipe.submit("stale-soft-leaving").operation_id
    wait_for(lambda: sandbox.requests(method="POST"), 20, interval_s=0.02, what="the call is out")
    child = _pool_process(w.pid)

    # Celery's cancel of the task on a connection loss (SIGTERM), then, while the process drains
    # its calls out (worker_process_shutdown), the cancelled task's soft limit.
    os.kill(child, signal.SIGTERM)
    time.sleep(0.3)
    os.kill(child, signal.SIGUSR1)

    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=30)
    assert op.result_reference
    assert [e["idempotency_key"] for e in sandbox.effects()] == [pk("stale-soft-leaving")]
    # The leaving process finalized its call: no lease expiry, no lookup at the provider.
    assert pipe.attempts(op_id, kind="lookup") == []
    assert [a.attempt_number for a in pipe.attempts(op_id, kind="dispatch")] == [1]
    wait_for(lambda: not _alive(child), 10, what="the pool process left")
    w.stop()
    log = w.log()
    # The parent's "Process ... exited with ..." is about the test's own SIGTERM (Celery's cancel goes
    # through the pool, which expects the exit); the leaving process says nothing above INFO.
    leaving = [line for line in log_records(log, "ERROR", "CRITICAL") if "/ForkPoolWorker-" in line.split("]")[0]]
    assert leaving == [], log[-3000:]
    assert "soft time limit signal ignored, armed for a task that has ended: the process is leaving" in log
