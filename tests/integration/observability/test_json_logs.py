"""OUTBOX_LOG_FORMAT=json, end to end: a real Celery worker and a real `agent-outbox relay` process
write one JSON object per line on stderr, and a dispatched operation's lines carry its ids (operation,
tenant, action, attempt, fencing token) as fields, not as text to parse."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.harness import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` as JSON: a line that is not one fails the test, naming it."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"not a JSON line on stderr: {line!r}")
    return out


def test_a_worker_and_the_relay_log_json_lines_with_the_operations_ids(pipe, sandbox, tmp_path):
    sandbox.add_fault(mode="unavailable_503", method="POST", count=1)  # a retry, then the success
    env = dict(os.environ) | pipe.env | {"OUTBOX_LOG_FORMAT": "json"}
    worker_err, relay_err = tmp_path / "worker.err", tmp_path / "relay.err"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers", "worker", "-P", "solo", "-Q", "dispatch,outcome_unknown",
         "-n", f"json-{uuid.uuid4().hex[:6]}@%h", "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=worker_err.open("wb"),
    )  # fmt: skip
    relay = subprocess.Popen(
        [sys.executable, "-m", "workers.cli.main", "--log-level", "INFO", "relay"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=relay_err.open("wb"),
    )  # fmt: skip
    try:
        wait_for(lambda: any("ready." in r["message"] for r in json_lines(worker_err)), 30, what="worker ready")
        r = pipe.submit("json-log")
        pipe.wait_status(r.operation_id, "succeeded", timeout_s=30)
        wait_for(lambda: [x for x in json_lines(worker_err) if x["message"] == "succeeded"], 10, what="its log line")
    finally:
        for proc in (worker, relay):
            proc.send_signal(signal.SIGTERM)
        for proc in (worker, relay):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    lines = json_lines(worker_err)
    mine = [x for x in lines if x.get("operation_id") == r.operation_id]
    retry = next(x for x in mine if x["message"].startswith("retry scheduled"))
    success = next(x for x in mine if x["message"] == "succeeded")
    for line, attempt in ((retry, 1), (success, 2)):
        assert line["level"] == "INFO" and line["logger"] == "workers.dispatch.finalize"
        assert (line["tenant"], line["action"], line["attempt"]) == ("t1", "payments.refund.create", attempt)
        assert isinstance(line["fencing_token"], int) and line["ts"].endswith("+00:00")
    assert retry["class"] == "not_processed" and success["reference"]
    assert not [x for x in lines if x["level"] == "ERROR"], "ERROR is for final failures"
    relay_lines = json_lines(relay_err)  # the relay: JSON too (at least its start-up line)
    assert relay_lines and all({"ts", "level", "logger", "message"} <= set(x) for x in relay_lines)


def test_a_bad_log_format_is_refused_naming_the_variable(tmp_path):
    env = dict(os.environ) | {"OUTBOX_LOG_FORMAT": "yaml", "OUTBOX_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli.main", "ops", "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "OUTBOX_LOG_FORMAT" in done.stderr and "text or json" in done.stderr


def test_the_api_servers_own_lines_are_json_too(tmp_path):
    """uvicorn's server and access logs under `agent-outbox serve` (embedded ledger, no services)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    err = tmp_path / "serve.err"
    env = dict(os.environ) | {"OUTBOX_LOG_FORMAT": "json", "OUTBOX_DATA_DIR": str(tmp_path)}
    env.pop("OUTBOX_DATABASE_URL", None)
    serve = subprocess.Popen(
        [sys.executable, "-m", "workers.cli.main", "serve", "--port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err.open("wb"),
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(ready, 30, what="the API ready")
        wait_for(lambda: [x for x in json_lines(err) if "/readyz" in x["message"]], 10, what="its access line")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)
    lines = json_lines(err)
    assert {x["logger"] for x in lines} >= {"uvicorn.error", "uvicorn.access"}
