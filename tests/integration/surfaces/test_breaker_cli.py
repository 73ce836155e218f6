"""`agent-outbox breaker status|reset` as real subprocesses against running workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from typing import Any

import pytest
import redis
from sqlalchemy import select

from outbox.ledger.history import HistoryEvent
from tests import spawn
from tests.harness import REFUND_ARGS, ROOT, action, actions_doc, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _cli(pipe: Any, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return spawn.run(
        [sys.executable, "-m", "workers.cli.main", "breaker", *args],
        cwd=ROOT,
        env=env or (dict(os.environ) | pipe.env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _status(pipe: Any) -> dict[str, Any]:
    out = _cli(pipe, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_reset_from_the_cli_closes_the_breaker_in_every_worker(pipe, sandbox):
    n = 6
    budget = {"max_attempts": 4, "deadline_s": 300, "base_delay_s": 0.1, "max_delay_s": 0.5}
    # reset_timeout_s 60: without the reset, the parked operations would wait a minute.
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            breaker={"fail_max": 2, "reset_timeout_s": 60},
            actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"], budget=budget)},
        )
    )
    sandbox.add_fault(mode="unavailable_503", method="POST", path="/v1/*")
    workers = [pipe.start_worker(), pipe.start_worker()]
    pipe.start_relay()
    ids = [pipe.submit(f"k-cli-{i}", dict(REFUND_ARGS, order_id=f"o-{i}")).operation_id for i in range(n)]
    wait_for(
        lambda: all(pipe.op(i).status == "not_dispatched" and pipe.op(i).waiting_for == "breaker" for i in ids),
        30,
        what="all operations parked by the breaker",
    )

    doc = _status(pipe)
    assert doc["namespace"] == pipe.env["OUTBOX_BROKER_KEY_PREFIX"]
    assert (doc["shared"], doc["storage"]) == (True, "redis")
    [row] = doc["breakers"]
    assert row["target"] == "sandbox" and row["state"] == "open"
    assert (row["failures"], row["fail_max"], row["reset_timeout_s"]) == (2, 2, 60.0)
    opened, reopens = datetime.fromisoformat(row["opened_at"]), datetime.fromisoformat(row["reopens_at"])
    assert abs((reopens - opened).total_seconds() - 60) < 0.01
    table = _cli(pipe, "status")
    assert table.returncode == 0 and "sandbox" in table.stdout and "open" in table.stdout

    unknown = _cli(pipe, "reset", "nope", "--by", "alice")
    assert unknown.returncode == 2 and "nope" in unknown.stderr and "sandbox" in unknown.stderr

    sandbox.clear_faults()
    sent_before = len(sandbox.requests(method="POST"))
    out = _cli(pipe, "reset", "sandbox", "--by", "alice")
    assert out.returncode == 0, out.stderr
    assert "alice" in out.stdout and f"{n} parked operation(s) due now" in out.stdout
    assert "breaker reset by operator" in out.stderr  # the WARNING log line

    # Every worker sees the reset on its next call: all complete long before the 60 s reopen time.
    wait_for(lambda: all(pipe.op(i).status == "succeeded" for i in ids), 10, what="all succeeded after reset")
    assert len(sandbox.requests(method="POST")) - sent_before == n
    for i in ids:
        assert len(sandbox.effects(key=pipe.op(i).provider_key)) == 1
        assert pipe.op(i).attempt_count <= 4
    doc = _status(pipe)
    assert (doc["breakers"][0]["state"], doc["breakers"][0]["failures"]) == ("closed", 0)
    assert doc["breakers"][0]["opened_at"] is None and doc["breakers"][0]["reopens_at"] is None
    # Who and when: on the breaker itself and on every operation it released.
    state_key = f"agent-outbox:breaker:{pipe.env['OUTBOX_BROKER_KEY_PREFIX']}:sandbox:state"
    fields = redis.Redis.from_url(pipe.env["OUTBOX_REDIS_URL"]).hgetall(state_key)
    assert fields[b"reset_by"] == b"alice" and int(fields[b"reset_at_ms"]) > 0
    with pipe.sessions() as s:
        actors = s.execute(
            select(HistoryEvent.operation_id, HistoryEvent.actor).where(HistoryEvent.event == "breaker reset")
        ).all()
    assert sorted(a.operation_id for a in actors) == sorted(ids) and {a.actor for a in actors} == {"alice"}
    for w in workers:
        assert ": ERROR/" not in w.log() and "Traceback" not in w.log()


def test_status_without_shared_state_says_so(pipe, sandbox):
    env = dict(os.environ) | pipe.env
    env.pop("OUTBOX_REDIS_URL")
    out = _cli(pipe, "status", env=env)
    assert out.returncode == 0 and "process-local" in out.stdout and "closed" not in out.stdout
    doc = json.loads(_cli(pipe, "status", "--json", env=env).stdout)
    assert (doc["shared"], doc["storage"]) == (False, "process-local")
    assert doc["breakers"][0]["target"] == "sandbox" and doc["breakers"][0]["state"] is None
    reset = _cli(pipe, "reset", "sandbox", env=env)
    assert reset.returncode == 2 and "OUTBOX_REDIS_URL" in reset.stderr
