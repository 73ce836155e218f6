"""F21: a poison intent kills its worker on every claim; it must park at the attempt cap.

A failpoint makes the worker ``os._exit(137)`` right after it claimed the poison key (before
anything is sent). Each crash leaves a PENDING attempt, which the ledger treats as possibly sent:
the lease expires, the sweep parks it in outcome_unknown, the reconciler's lookup proves "never
executed" and re-dispatches with the same key... which must stop at the action's max_attempts.
Meanwhile other intents keep flowing through the surviving and replacement workers.
"""

from __future__ import annotations

import time

import pytest

from outbox.ledger.states import Status
from tests.harness import CLOCK_LEASE, action, actions_doc, pk

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
MAX_ATTEMPTS = 2
PARKED = (Status.OUTCOME_UNKNOWN.value, Status.RECONCILIATION_REQUIRED.value)


def test_poison_intent_parks_at_the_attempt_cap_while_others_flow(pipe, sandbox):
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={
                "payments.refund.create": action(
                    REFUNDS,
                    decimal_args=["amount"],
                    budget={"max_attempts": MAX_ATTEMPTS, "deadline_s": 120, "base_delay_s": 0.1, "max_delay_s": 0.5},
                ),
            },
        )
    )
    # One id per doorbell: a poison intent that kills its worker takes its whole doorbell batch
    # through lease expiry and reconciliation (documented cost of OUTBOX_DOORBELL_BATCH); this
    # test is about the poison intent's own cap.
    pipe.env["OUTBOX_DOORBELL_BATCH"] = "1"
    # Likewise for the calls a process holds in flight: a crash takes them all through lease
    # expiry, and here the good ones' leases never run out (CLOCK_LEASE).
    pipe.env["OUTBOX_MAX_IN_FLIGHT"] = "1"
    pipe.env.update(CLOCK_LEASE)
    env = {"OUTBOX_FAILPOINTS": "dispatch.after_claim=exit@poison-*"}
    pipe.start_worker("w1", extra_env=env)
    pipe.start_worker("w2", extra_env=env)
    pipe.start_relay()
    poison = pipe.submit("poison-1").operation_id
    good = [
        pipe.submit(f"good-{i}", args={"order_id": f"o-{i}", "amount": "1.00", "currency": "EUR"}).operation_id
        for i in range(6)
    ]

    crashes = 0
    deadline = time.monotonic() + 40
    while True:
        # Replace dead workers, as a supervisor (systemd, k8s) would.
        for w in list(pipe.workers):
            if w.proc.poll() is not None and not getattr(w, "replaced", False):
                w.replaced = True  # type: ignore[attr-defined]
                crashes += 1
                pipe.start_worker(f"r{crashes}", extra_env=env)
                # The dead worker's lease on the poison intent runs out (the good ones' clocks stand still).
                pipe.advance_ledger_clock(pipe.lease_s, operation_ids=[poison])
        op = pipe.op(poison)
        if op.status == Status.RECONCILIATION_REQUIRED.value and all(
            pipe.op(g).status == Status.SUCCEEDED.value for g in good
        ):
            break
        assert op.attempt_count <= MAX_ATTEMPTS, f"claimed {op.attempt_count} times, cap {MAX_ATTEMPTS}"
        assert time.monotonic() < deadline, (
            f"poison now {op.status} after {op.attempt_count} claims, {crashes} crashes: {op.reason}; "
            f"good: {[pipe.op(g).status for g in good]}"
        )
        time.sleep(0.1)

    op = pipe.op(poison)
    assert op.status in PARKED
    assert op.attempt_count == MAX_ATTEMPTS
    dispatches = pipe.attempts(poison, "dispatch")
    assert len(dispatches) == MAX_ATTEMPTS and {a.attempt_class for a in dispatches} == {"pending"}
    assert crashes == MAX_ATTEMPTS
    # Never sent at all (it died before sending), so nothing to count but zero.
    assert sandbox.requests(method="POST", key=pk("poison-1")) == []
    assert sandbox.effects(key=pk("poison-1")) == []
    for i in range(len(good)):
        assert len(sandbox.effects(key=pk(f"good-{i}"))) == 1
    assert sandbox.duplicates() == []
