"""F17: a worker's clock is minutes off (libfaketime on the worker processes, both directions).

Deadlines, due times, settle windows and leases use the database's clock; an HTTP-date Retry-After
is read against the response's Date header. So a worker 5 minutes fast must not call every intent
past its deadline, and one 5 minutes slow must not wait 5 minutes more than the provider asked.
Outcomes and waits are compared with a run's expectations, counted at the sandbox.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from outbox.ledger.states import Status
from tests.harness import action, actions_doc, pk

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

REFUNDS = "/v1/refunds"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW_S = 300
RETRY_AFTER_S = 30  # waited by moving the clocks: a wait of the real length proves nothing is off


def _faketime_env(offset_s: int) -> dict[str, str]:
    if not LIBFAKETIME.exists() or shutil.which("faketime") is None:
        if os.environ.get("CI"):
            pytest.fail("libfaketime is required in CI (Debian package faketime; .ci/run installs it)")
        pytest.skip("libfaketime not installed: `apt-get install faketime`")
    # Monotonic time stays true: only the wall clock is off, as on a host whose NTP is broken.
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": f"{offset_s:+d}s", "DONT_FAKE_MONOTONIC": "1"}


def _posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sorted(sandbox.requests(method="POST", path=REFUNDS, key=pk(key)), key=lambda e: e["seq"])


@pytest.mark.parametrize("offset_s", [SKEW_S, -SKEW_S], ids=["worker-5-min-fast", "worker-5-min-slow"])
def test_a_skewed_worker_clock_changes_no_outcome_and_no_wait(pipe, sandbox, offset_s):
    skewed = _faketime_env(offset_s)
    budget = {"max_attempts": 4, "deadline_s": 60, "base_delay_s": 0.1, "max_delay_s": 1}
    pipe.write_actions(
        actions_doc(
            sandbox.url, actions={"payments.refund.create": action(REFUNDS, decimal_args=["amount"], budget=budget)}
        )
    )
    sandbox.add_fault(
        mode="rate_limited_429",
        method="POST",
        path=REFUNDS,
        key_pattern=pk("skew-429"),
        count=1,
        retry_after_s=RETRY_AFTER_S,
        retry_after_http_date=True,
    )
    # Cut before commit: ambiguous, looked up, not found once the settle window has passed.
    sandbox.add_fault(mode="drop_before_commit", method="POST", path=REFUNDS, key_pattern=pk("skew-reset"), count=1)
    pipe.start_worker("dispatcher", queues="dispatch", extra_env=skewed)
    pipe.start_worker("reconciler", queues="outcome_unknown", extra_env=skewed)
    pipe.start_relay()
    keys = ["skew-429", "skew-reset"] + [f"skew-plain-{i}" for i in range(6)]
    ops = {
        key: pipe.submit(key, args={"order_id": key, "amount": "3.00", "currency": "EUR"}).operation_id for key in keys
    }

    # The provider asks for 30 s (an HTTP-date 30 s after its own Date header): the retry is due
    # about that long after the answer, on the ledger's clock, neither 5 minutes more nor at once.
    limited = ops["skew-429"]
    att = pipe.wait_attempt_done(limited, 1)
    assert att.status_code == 429 and RETRY_AFTER_S - 1.0 <= att.retry_after_s <= RETRY_AFTER_S + 2.0, att
    wait = (pipe.op(limited).next_attempt_at - att.ended_at).total_seconds()
    assert RETRY_AFTER_S - 1.0 <= wait <= RETRY_AFTER_S + 2.0, wait
    sandbox.advance_clock(pipe.advance_to_due(limited))
    # The cut request: looked up, and "not found" counts once the settle window has passed.
    cut = ops["skew-reset"]
    pipe.wait_attempt_done(cut, 1, kind="lookup")
    if pipe.op(cut).status == Status.OUTCOME_UNKNOWN.value:  # the lookup came inside the window
        pipe.advance_to_due(cut)

    for key, op_id in ops.items():
        op = pipe.wait_status(op_id, Status.SUCCEEDED.value, Status.FAILED_BEFORE_COMMIT.value, timeout_s=30)
        assert op.status == Status.SUCCEEDED.value, (key, op.reason)
        effects = sandbox.effects(key=pk(key))
        assert len(effects) == 1 and op.result_reference == effects[0]["object_id"], key

    # At the provider, on its clock (moved with the ledger's): waited about that long.
    first, second = _posts(sandbox, "skew-429")
    assert first["status"] == 429 and second["status"] == 200
    waited_s = second["clock_time"] - first["clock_time"]
    assert RETRY_AFTER_S - 1.0 <= waited_s <= RETRY_AFTER_S + 6.0, waited_s
    # The cut request was looked up and sent again with the same key, once.
    assert [p["status"] for p in _posts(sandbox, "skew-reset")][-1] == 200
    assert sandbox.duplicates() == []
