"""Flower against the Redis broker sees our workers and tasks, and no business data in them; it demands
credentials, as docker-compose.yml runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import httpx
import pytest

from tests import spawn
from tests.harness import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_flower_shows_workers_and_tasks_with_operation_ids_only(pipe, sandbox, tmp_path):
    pytest.importorskip("flower")
    # Deployments that run Flower turn task events on from the start (docker-compose.yml does).
    pipe.env["OUTBOX_TASK_EVENTS"] = "true"
    worker = pipe.start_worker("flowerw")
    pipe.start_relay()
    port = _free_port()
    # As docker-compose.yml runs it: credentials required (FLOWER_BASIC_AUTH).
    env = dict(os.environ) | pipe.env | {"FLOWER_BASIC_AUTH": "ops:s3cret"}
    log = open(tmp_path / "flower.log", "wb")
    flower = spawn.popen(
        [sys.executable, "-m", "celery", "-A", "workers", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{base}/healthcheck") == "OK", 30, what="flower up")
        # Flower shows only the events it received: wait until its receiver sees the worker first
        # (a doorbell task takes milliseconds; under load it could end before Flower listened).
        assert httpx.get(f"{base}/api/workers", timeout=5).status_code == 401  # no credentials, nothing shown
        assert httpx.get(f"{base}/", timeout=5, auth=("ops", "wrong")).status_code == 401
        workers = wait_for(lambda: _json(f"{base}/api/workers?refresh=1"), 30, what="flower sees workers")
        assert any("flowerw" in name for name in workers), workers
        secret = {"order_id": "o-9", "amount": "77.10", "currency": "EUR", "reason": "customer-secret-reason"}
        receipt = pipe.submit("k-flower", secret)
        pipe.wait_status(receipt.operation_id, "succeeded")
        # The operation's call is the task (named after its action); the doorbell sends no events.
        tasks = wait_for(
            lambda: [
                t
                for t in (_json(f"{base}/api/tasks") or {}).values()
                if t.get("name") == "outbox.payments.refund.create"
            ],
            30,
            what="flower sees the task",
        )
        shown = json.dumps(tasks)
        assert receipt.operation_id in shown
        for value in ("k-flower", "77.10", "customer-secret-reason", "o-9"):
            assert value not in shown, f"{value!r} leaked into Flower"
    finally:
        flower.terminate()
        flower.wait(10)
        worker.stop()


def _get(url: str) -> str:
    try:
        return httpx.get(url, timeout=2).text
    except httpx.HTTPError:
        return ""


def _json(url: str):  # type: ignore[no-untyped-def]
    try:
        r = httpx.get(url, timeout=5, auth=("ops", "s3cret"))
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
