"""OUTBOX_LOG_FORMAT=json means every line: `agent-outbox run` (its own start line, the Celery
worker it starts with its banner and its shutdown line), a Celery worker and Celery beat write
nothing on stdout or stderr that is not one JSON object; the banners' facts are one record each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def every_line_json(path: Path) -> list[dict[str, Any]]:
    """Each line of ``path`` (stdout and stderr together) as JSON; one that is not fails, named."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            pytest.fail(f"an empty line in {path.name}: a log shipper sees a line that is not JSON")
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line in {path.name}: {line!r}")
    return records


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_agent_outbox_run_writes_only_json_lines(pipe, sandbox, tmp_path):
    sandbox.add_fault(mode="unavailable_503", method="POST", count=1)  # a retry: more lines
    env = (
        dict(os.environ)
        | pipe.env
        | {"OUTBOX_LOG_FORMAT": "json", "OUTBOX_ACTIONS_FILE": str(pipe.tmp / "actions.yaml")}
    )
    out = tmp_path / "run.out"
    run = subprocess.Popen(
        [sys.executable, "-m", "workers.cli.main", "run", "--concurrency", "1"],
        cwd=tmp_path, env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: "ready." in out.read_text(errors="replace"), 60, what="the worker of `run` ready")
        receipt = pipe.submit("json-run")
        pipe.wait_status(receipt.operation_id, "succeeded", timeout_s=30)
    finally:
        _stop(run)
    records = every_line_json(out)
    messages = [r["message"] for r in records]
    assert any(m.startswith("agent-outbox running: ledger ") for m in messages), messages
    banner = next(r for r in records if r["message"] == "celery worker starting")
    assert banner["queues"] == ["dispatch", "outcome_unknown"] and banner["pool"] == "prefork", banner
    assert "worker: Warm shutdown (MainProcess)" in messages
    assert any(r.get("operation_id") == receipt.operation_id and r["message"] == "succeeded" for r in records)


def test_a_celery_worker_and_beat_write_only_json_lines(pipe, tmp_path):
    worker = pipe.start_worker("jsonw", extra_env={"OUTBOX_LOG_FORMAT": "json"})  # stdout and stderr: its log
    worker.stop()
    records = every_line_json(worker.log_path)
    banner = next(r for r in records if r["message"] == "celery worker starting")
    assert "jsonw" in banner["hostname"] and banner["transport"].startswith("redis://"), banner
    assert any(r["message"] == "worker: Warm shutdown (MainProcess)" for r in records)

    out = tmp_path / "beat.out"
    env = dict(os.environ) | pipe.env | {"OUTBOX_LOG_FORMAT": "json"}
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "beat", "--loglevel", "INFO",
         "--schedule", str(tmp_path / "beat-schedule")],
        cwd=tmp_path, env=env, stdout=out.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: "celery beat starting" in out.read_text(errors="replace"), 60, what="beat started")
    finally:
        _stop(beat)
    facts = next(r for r in every_line_json(out) if r["message"] == "celery beat starting")
    assert facts["scheduler"] == "BeatScheduler" and facts["max_interval_s"], facts
