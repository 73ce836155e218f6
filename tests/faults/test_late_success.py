"""F22: a request that lands after its worker lost the lease and after a lookup said "not found".

The issue-12 timeline, with real processes: a dispatch worker claims an operation and is frozen
(SIGSTOP) between its claim and its send; its lease expires; the reconciler's lookup finds nothing
and the operation is due again under the same key; then the worker is thawed (SIGCONT) and its old
request reaches the sandbox. Timing proves nothing about such a request: only fencing, evidence or
a person does. So, for a provider that fences and one that does not, with and without the deadline
passing while the worker is frozen, the operation must end in a state that matches what the sandbox
counted, and must never sit in failed_before_commit while the sandbox holds an effect.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from outbox.ledger.states import Status
from tests.harness import CLOCK_LEASE, action, actions_doc, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
# Longer than the lease, so the first lookup (after the lease ran out) re-dispatches; it passes
# while the worker is frozen only because the test moves the ledger's clock past it.
DEADLINE_S = 2 * int(CLOCK_LEASE["OUTBOX_LEASE_S"])


class LieWatch:
    """Samples (effects at the sandbox, then the operation's status) until stopped: a sample with an
    effect already counted and the status failed_before_commit is the lie this test is about."""

    def __init__(self, pipe: Any, sandbox: Any, op_id: str, key: str) -> None:
        self.pipe, self.sandbox, self.op_id, self.key = pipe, sandbox, op_id, key
        self.lies: list[str] = []
        self.statuses: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            effects = len(self.sandbox.effects(key=pk(self.key)))
            status = self.pipe.op(self.op_id).status
            if not self.statuses or self.statuses[-1] != status:
                self.statuses.append(status)
            if effects and status == Status.FAILED_BEFORE_COMMIT.value:
                self.lies.append(f"failed_before_commit beside {effects} effect(s)")

    def __enter__(self) -> LieWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sorted(sandbox.requests(method="POST", path=REFUNDS, key=pk(key)), key=lambda e: e["seq"])


@pytest.mark.parametrize("deadline_passes", [False, True], ids=["budget-left", "deadline-passes"])
@pytest.mark.parametrize("fencing", [False, True], ids=["provider-does-not-fence", "provider-fences"])
def test_a_frozen_workers_late_request_never_leaves_a_lie(pipe, sandbox, fencing, deadline_passes):
    key = f"f22-{'fenced' if fencing else 'plain'}-{'deadline' if deadline_passes else 'budget'}"
    sandbox.configure(strict_fencing=fencing)
    budget = {
        "max_attempts": 4,
        "deadline_s": DEADLINE_S if deadline_passes else 3600,
        "base_delay_s": 0.1,
        "max_delay_s": 1,
    }
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={
                "payments.refund.create": action(
                    REFUNDS, decimal_args=["amount"], provider_fencing=fencing, budget=budget
                )
            },
        )
    )
    pipe.env.update(CLOCK_LEASE)
    # The owner stalls after its last check, as its request is about to leave, long enough for us
    # to freeze it there: whatever happens meanwhile, it sends when thawed.
    zombie = pipe.start_worker(
        "zombie", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": f"dispatch.before_send=sleep:1.5@{key}"}
    )
    pipe.start_worker("reconciler", queues="outcome_unknown")
    pipe.start_relay()
    op_id = pipe.submit(key).operation_id

    with LieWatch(pipe, sandbox, op_id, key) as watch:
        wait_for(
            lambda: (
                (op := pipe.op(op_id)).status == Status.DISPATCHING.value and op.lease_owner.endswith(f":{zombie.pid}")
            ),
            10,
            interval_s=0.02,
            what="the zombie's claim",
        )
        zombie.freeze()
        try:
            owner_token = pipe.op(op_id).fencing_token
            # The lease runs out -> outcome_unknown -> the lookup finds nothing -> due again, same key.
            pipe.advance_ledger_clock(pipe.lease_s)
            pipe.wait_status(op_id, Status.NOT_DISPATCHED.value, timeout_s=15)
            lookups = sandbox.requests(method="GET", path=REFUNDS, key=pk(key))
            assert lookups and all(r["status"] == 404 for r in lookups)
            # Every lookup carried the reconciler's token, newer than the frozen worker's.
            assert all(int(r["fencing_token"]) > owner_token for r in lookups), lookups
            assert _posts(sandbox, key) == []  # the frozen request has not left yet
            if deadline_passes:
                # A successor takes the re-dispatch only after the deadline: nothing may be sent,
                # and "not found" again cannot prove the frozen request away unless the provider
                # fences. Where it does not, the reconciler keeps looking (its own budget) rather
                # than handing a person what a later lookup may still settle.
                pipe.advance_ledger_clock(DEADLINE_S)
                pipe.start_worker("successor", queues="dispatch")
                if fencing:
                    pipe.wait_status(op_id, Status.FAILED_BEFORE_COMMIT.value, timeout_s=20)
                else:
                    op = wait_for(
                        lambda: (
                            (o := pipe.op(op_id)).status == Status.OUTCOME_UNKNOWN.value
                            and "looking again" in (o.reason or "")
                            and o
                        ),
                        20,
                        what=lambda: f"a lookup past the deadline looking again (now {pipe.op(op_id).status})",
                    )
                    assert "may still take effect" in op.reason and "attempt 1 (token" in op.reason, op.reason
                assert _posts(sandbox, key) == [], "nothing is sent past the deadline"
        finally:
            zombie.thaw()

        # The frozen request reaches the provider now, with its old token.
        first = wait_for(
            lambda: (p := _posts(sandbox, key)) and p[0]["status"] is not None and p[0],
            10,
            what="the thawed worker's POST",
        )
        assert int(first["fencing_token"]) == owner_token
        if fencing:
            # The lookup's newer token locked it out at the provider.
            assert first["status"] == 409 and first["object_id"] is None
        else:
            assert first["status"] == 200 and first["object_id"] is not None

        expected = Status.FAILED_BEFORE_COMMIT.value if fencing and deadline_passes else Status.SUCCEEDED.value
        op = pipe.wait_status(op_id, expected, timeout_s=15)
        wait_for(lambda: pipe.attempts(op_id, "dispatch")[0].ended_at is not None, 10, what="attempt 1 written")
        watch_statuses = watch.statuses

    assert watch.lies == [], (watch.lies, watch_statuses)
    effects = sandbox.effects(key=pk(key))
    [attempt1, *later] = pipe.attempts(op_id, "dispatch")
    assert attempt1.fencing_token == owner_token and attempt1.stale is True
    if expected == Status.SUCCEEDED.value:
        assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
        if fencing:
            # Refused at the provider; a fresh attempt under the current token made the one effect.
            assert attempt1.status_code == 409 and later and later[-1].attempt_class == "succeeded"
        else:
            # Evidence wins: the late success itself settled the operation; nothing was sent again.
            assert attempt1.attempt_class == "succeeded" and attempt1.provider_reference == op.result_reference
            assert "evidence wins" in op.reason
            assert len(_posts(sandbox, key)) == 1
    else:
        assert effects == [], "failed_before_commit while the sandbox counts an effect"
        assert attempt1.status_code == 409
    assert sandbox.duplicates() == []
