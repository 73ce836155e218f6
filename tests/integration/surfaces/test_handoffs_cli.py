"""Handoffs driven through the CLI as a person would (``agent-outbox handoffs list/show/resolve``),
against real workers, PostgreSQL, Redis and the sandbox.

The action declares no lookup, so an ambiguous attempt goes straight to a person.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import spawn
from tests.harness import ROOT, action, actions_doc, pk

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def cli(pipe, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ) | pipe.env
    return spawn.run(
        [sys.executable, "-m", "workers.cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def cli_json(pipe, *args: str):
    done = cli(pipe, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_resolutions_are_written_back_and_acted_on(pipe, sandbox):
    pipe.write_actions(
        actions_doc(
            sandbox.url, actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"], lookup=None)}
        )
    )
    # "done": committed, answer lost. "never": the provider refused before executing, but the
    # client saw a 500 (ambiguous). Without a lookup both need a person.
    sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("h-done"), count=1)
    sandbox.add_fault(mode="fail_before_commit", method="POST", status=500, key_pattern=pk("h-never"), count=1)
    pipe.start_worker()
    pipe.start_relay()
    done, never = pipe.submit("h-done"), pipe.submit("h-never")
    pipe.wait_status(done.operation_id, "reconciliation_required")
    pipe.wait_status(never.operation_id, "reconciliation_required")

    listed = {h["operation_id"]: h for h in cli_json(pipe, "handoffs", "list")}
    assert set(listed) == {done.operation_id, never.operation_id}
    table = cli(pipe, "handoffs", "list")
    assert table.returncode == 0 and "h-done" in table.stdout and "h-never" in table.stdout
    shown = cli_json(pipe, "handoffs", "show", str(listed[done.operation_id]["handoff_id"]))
    assert shown["packet"]["operation"]["idempotency_key"] == "h-done"
    assert "declares no lookup" in shown["packet"]["next_step"]
    human = cli(pipe, "handoffs", "show", str(listed[done.operation_id]["handoff_id"]))
    assert human.returncode == 0 and "4. next step" in human.stdout

    # A person finds the refund at the provider and records its reference.
    reference = sandbox.effects(key=pk("h-done"))[0]["object_id"]
    out = cli(
        pipe,
        "handoffs",
        "resolve",
        str(listed[done.operation_id]["handoff_id"]),
        "--as",
        "succeeded",
        "--reference",
        reference,
        "--by",
        "alice",
        "--note",
        "found in the provider dashboard",
    )
    assert out.returncode == 0, out.stderr
    # Another confirms the other one never happened: re-dispatched with the SAME key.
    out = cli(
        pipe,
        "handoffs",
        "resolve",
        str(listed[never.operation_id]["handoff_id"]),
        "--as",
        "not-executed",
        "--by",
        "bob",
        "--note",
        "provider support: no such refund",
    )
    assert out.returncode == 0, out.stderr
    op = pipe.wait_status(never.operation_id, "succeeded")
    sent = sandbox.requests(method="POST", key=pk("h-never"))
    assert [p["status"] for p in sent] == [500, 200] and sent[1]["fencing_token"] > sent[0]["fencing_token"]
    assert op.result_reference == sandbox.effects(key=pk("h-never"))[0]["object_id"]
    assert len(sandbox.effects(key=pk("h-done"))) == 1 and len(sandbox.requests(method="POST", key=pk("h-done"))) == 1

    # Both decisions are in the operation history: who, when, why.
    shown_done = cli_json(pipe, "ops", "show", done.operation_id)
    assert shown_done["status"] == "succeeded" and shown_done["result"]["reference"] == reference
    ev = [e for e in shown_done["history"] if e["event"] == "resolved: succeeded"]
    assert len(ev) == 1 and ev[0]["actor"] == "alice" and ev[0]["reason"] == "found in the provider dashboard"
    assert ev[0]["at"]
    shown_never = cli_json(pipe, "ops", "show", never.operation_id)
    ev = [e for e in shown_never["history"] if e["event"] == "resolved: not executed"]
    assert len(ev) == 1 and ev[0]["actor"] == "bob" and ev[0]["reason"] == "provider support: no such refund"
    assert ev[0]["at"] and ev[0]["to"] == "not_dispatched"

    # The handoffs are closed with their resolution; a second resolve is refused (exit 2).
    all_ = {h["operation_id"]: h for h in cli_json(pipe, "handoffs", "list", "--all")}
    assert all_[done.operation_id]["resolution"] == "succeeded"
    assert all_[done.operation_id]["resolved_reference"] == reference
    assert all_[never.operation_id]["resolved_by"] == "bob" and all_[never.operation_id]["resolved_at"]
    assert cli_json(pipe, "handoffs", "list") == []
    again = cli(
        pipe,
        "handoffs",
        "resolve",
        str(listed[done.operation_id]["handoff_id"]),
        "--as",
        "abandoned",
        "--by",
        "carol",
        "--note",
        "twice",
    )
    assert again.returncode == 2 and "already resolved" in again.stderr
