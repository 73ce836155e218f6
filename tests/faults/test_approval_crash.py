"""Crashes between a person's approval and the send (FAULTS.md F01 with approval).

An intent that needs approval is approved (the approval committed), then the process that should
carry it dies: the dispatch worker right after its claim, before anything is sent (``os._exit``
at a failpoint, as after a SIGKILL); or the relay, so nobody rang the doorbell for the approved
operation. What must hold, counted at the sandbox: the operation is picked up again (lease expiry
and the reconciler's lookup, or the next relay's poll), exactly one effect, ``succeeded``; the
approval on record is honoured and checked again at the new claim, under its fencing token, and
is not asked for twice. If it expired while the worker was dead, the new claim must see that and
send nothing until a person approves again.

Real Celery worker processes, the relay (a thread, or an ``agent-outbox relay`` process where it is
the one killed), PostgreSQL, Redis, the CLI and the sandbox over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import select

from outbox.approvals.decisions import history
from outbox.ledger.history import HistoryEvent
from outbox.ledger.states import EventKind, Status
from tests import spawn
from tests.faults.test_dispatch_faults import holds
from tests.harness import CLOCK_LEASE, REFUND_ARGS, ROOT, action, actions_doc, pk, wait_for
from tests.integration.surfaces.test_tenants import _cli
from workers.provider.actions import load_actions

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
BIG = dict(REFUND_ARGS, amount="900.00")
# Longer than the lease (CLOCK_LEASE), so running the lease out leaves the approval valid; the
# expired case moves the clock past it on purpose.
TTL_S = 600


def _rules(pipe: Any, sandbox: Any) -> Any:
    refund = action(
        REFUNDS,
        decimal_args=["amount"],
        approval={
            "required": "when",
            "when": "amount > 500",
            "ttl_s": TTL_S,
            "policy_version": "refunds-v3",
            "separate_approver": True,
        },
        # A deadline no clock move here reaches: only the approval may lapse.
        budget={"max_attempts": 4, "deadline_s": 3600, "base_delay_s": 0.1, "max_delay_s": 1},
    )
    pipe.write_actions(actions_doc(sandbox.url, actions={"payments.refund.create": refund}))
    return load_actions(pipe.env["OUTBOX_ACTIONS_FILE"])


def _approve(pipe: Any, op_id: str, by: str) -> None:
    done = _cli(pipe, "approvals", "approve", op_id, "--by", by)
    assert done.returncode == 0, done.stderr


def _posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sorted(sandbox.requests(method="POST", path=REFUNDS, key=pk(key)), key=lambda e: e["seq"])


def _events(pipe: Any, op_id: str) -> list[tuple[str, str]]:
    with pipe.sessions() as s:
        rows = s.execute(
            select(HistoryEvent.event, HistoryEvent.to_status)
            .where(HistoryEvent.operation_id == op_id)
            .order_by(HistoryEvent.id)
        ).all()
    return [(e, to) for e, to in rows]


def _asked_for_approval_again(pipe: Any, op_id: str) -> list[tuple[str, str]]:
    """Moves back to awaiting_approval after the first approval."""
    events = _events(pipe, op_id)
    first = [e for e, _ in events].index(EventKind.APPROVE.value)
    return [(e, to) for e, to in events[first + 1 :] if to == Status.AWAITING_APPROVAL.value]


@pytest.mark.parametrize("approval", ["holds", "expired"])
def test_worker_killed_after_claiming_an_approved_intent(pipe, sandbox, approval):
    key = f"f01-approved-{approval}"
    rules = _rules(pipe, sandbox)
    pipe.env.update(CLOCK_LEASE)
    victim = pipe.start_worker(
        "victim", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": f"dispatch.after_claim=exit@{key}"}
    )
    pipe.start_worker("reconciler", queues="outcome_unknown")
    pipe.start_relay()
    op_id = pipe.submit(key, dict(BIG), rules=rules, subject="agent:bot").operation_id
    assert pipe.op(op_id).status == Status.AWAITING_APPROVAL.value

    _approve(pipe, op_id, "alice")
    wait_for(lambda: victim.proc.poll() is not None, 15, what="the worker dead at its claim")
    op = pipe.op(op_id)
    assert op.status == Status.DISPATCHING.value and op.attempt_count == 1
    victim_token = op.fencing_token
    assert _posts(sandbox, key) == []  # it died before sending

    successor = pipe.start_worker("successor", queues="dispatch")
    # The dead worker's lease runs out (the sweep parks it: it may have sent), the reconciler's
    # lookup proves nothing was sent, and the operation is due again for the successor. Where the
    # approval expires meanwhile, the clock moves past it too.
    pipe.advance_ledger_clock(pipe.lease_s if approval == "holds" else TTL_S + 1)

    if approval == "expired":
        # The new claim checks the approval again, under its own token: lapsed, nothing sent.
        op = pipe.wait_status(op_id, Status.AWAITING_APPROVAL.value, timeout_s=20)
        assert "expired" in op.reason and op.waiting_for == "approval", op.reason
        holds(lambda: _posts(sandbox, key) == [], 0.5, "nothing sent on an expired approval")
        refused = pipe.attempts(op_id, "dispatch")[-1]
        assert refused.attempt_class == "not_sent" and "expired" in (refused.error or "")
        assert refused.fencing_token > victim_token
        _approve(pipe, op_id, "carol")

    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=20)
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    [post] = _posts(sandbox, key)
    # Sent by the successor under the newest token, the dead worker's claim fenced out.
    sent = pipe.attempts(op_id, "dispatch")[-1]
    assert sent.attempt_class == "succeeded" and sent.worker.endswith(f":{successor.pid}")
    assert int(post["fencing_token"]) == sent.fencing_token == op.fencing_token > victim_token
    dead = pipe.attempts(op_id, "dispatch")[0]
    assert dead.fencing_token == victim_token and dead.attempt_class == "pending"
    assert pipe.attempts(op_id, "lookup"), "the crash was settled by a lookup, not by a blind re-send"
    with pipe.sessions() as s:
        decisions = [(a.decision, a.approver) for a in history(s, op_id)]
    if approval == "holds":
        # Honoured across the crash: one approval, never asked for again.
        assert decisions == [("approved", "alice")]
        assert _asked_for_approval_again(pipe, op_id) == []
    else:
        assert decisions == [("approved", "alice"), ("approved", "carol")]
        assert len(_asked_for_approval_again(pipe, op_id)) == 1
    assert sandbox.duplicates() == []


def test_relay_killed_when_the_approval_commits(pipe, sandbox):
    """The approval commits while no relay is alive to ring for it (the one running was SIGKILLed):
    the next relay finds the approved operation by polling the ledger; one effect."""
    key = "f01-approved-relay"
    rules = _rules(pipe, sandbox)
    pipe.start_worker()
    log = open(pipe.tmp / "relay.log", "wb")
    relay = spawn.popen(
        [sys.executable, "-m", "workers.cli.main", "relay"],
        cwd=ROOT,
        env=dict(os.environ) | pipe.env | {"OUTBOX_RELAY_POLL_S": "0.1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The relay is alive and ringing: an intent below the approval threshold goes through.
        small = pipe.submit(f"{key}-small", dict(REFUND_ARGS), rules=rules, subject="agent:bot").operation_id
        pipe.wait_status(small, Status.SUCCEEDED.value, timeout_s=20)
        op_id = pipe.submit(key, dict(BIG), rules=rules, subject="agent:bot").operation_id
        assert pipe.op(op_id).status == Status.AWAITING_APPROVAL.value
        os.kill(relay.pid, signal.SIGKILL)
        relay.wait(10)
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait(10)
        log.close()

    _approve(pipe, op_id, "alice")
    op = pipe.op(op_id)
    assert op.status == Status.NOT_DISPATCHED.value and op.published_at is None
    holds(
        lambda: _posts(sandbox, key) == [] and pipe.op(op_id).status == Status.NOT_DISPATCHED.value,
        1.0,
        "approved, and nobody rings for it",
    )

    pipe.start_relay()
    op = pipe.wait_status(op_id, Status.SUCCEEDED.value, timeout_s=20)
    effects = sandbox.effects(key=pk(key))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    assert len(_posts(sandbox, key)) == 1 and len(pipe.attempts(op_id, "dispatch")) == 1
    with pipe.sessions() as s:
        assert [(a.decision, a.approver) for a in history(s, op_id)] == [("approved", "alice")]
    assert _asked_for_approval_again(pipe, op_id) == []
    assert sandbox.duplicates() == []
