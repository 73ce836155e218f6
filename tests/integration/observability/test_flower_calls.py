"""Flower shows the calls, not the doorbells: a real Flower beside the relay, two dispatch workers, a
reconciler and the sandbox with a fault mix. Through Flower's HTTP API every operation is a task
named after its action, in the state the ledger has it in; its retries, its lookups and its unknown
outcome are shown as such; Flower's views (name filter, task page, dashboard counts) work; and no
argument of the intent is in any event."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest

from tests import spawn
from tests.harness import pk, wait_for
from workers.sandbox.testing import free_port

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

AUTH = ("ops", "s3cret")
NAME = "outbox.payments.refund.create"
LOOKUP = "outbox.lookup.payments.refund.create"
# In every intent's arguments: none of these may appear in any event, nor anywhere in Flower.
CANARIES = ("ord-canary-5e1f0b", "canary-reason-a93c7d", "991.37")


def _start_flower(pipe: Any, tmp_path: Any) -> tuple[subprocess.Popen[bytes], str]:
    """Flower (basic auth AUTH) on a free port over the pipe's broker: its process and base URL."""
    port = free_port()
    env = dict(os.environ) | pipe.env | {"FLOWER_BASIC_AUTH": ":".join(AUTH)}
    flower = spawn.popen(
        [sys.executable, "-m", "celery", "-A", "workers", "flower", f"--port={port}", "--address=127.0.0.1"],
        env=env, cwd=tmp_path, stdout=open(tmp_path / "flower.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    return flower, f"http://127.0.0.1:{port}"


class EventTap:
    """Every Celery event on the broker, raw, as any event consumer receives it (a thread here)."""

    def __init__(self, app: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.connection = app.connection()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> EventTap:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(5)
        self.connection.release()

    def of(self, uuid: str) -> list[str]:
        return [e["type"] for e in list(self.events) if e.get("uuid") == uuid]


def test_every_call_is_a_task_in_flower_in_the_ledgers_state(pipe, sandbox, tmp_path):
    pytest.importorskip("flower")
    pipe.env["OUTBOX_TASK_EVENTS"] = "true"
    from workers.wiring.celery_app import make_app

    tap = EventTap(make_app(pipe.settings())).start()
    flower, base = _start_flower(pipe, tmp_path)
    try:
        sandbox.add_fault(mode="rate_limited_429", method="POST", key_pattern=pk("f-429"), count=1, retry_after_s=0.3)
        sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("f-lost"), count=1)
        sandbox.add_fault(mode="reject_422", method="POST", key_pattern=pk("f-rejected"))
        dispatchers = [pipe.start_worker(f"disp{i}", queues="dispatch") for i in (1, 2)]
        reconciler = pipe.start_worker("recon", queues="outcome_unknown")
        names = [w.name for w in [*dispatchers, reconciler]]
        # Flower shows only what its event receiver took in: its dashboard lists a worker once
        # that worker's events reached it.
        wait_for(
            lambda: all(any(n in (w.get("hostname") or "") for w in _dashboard(base)) for n in names),
            60,
            what="Flower receives the three workers' events",
        )
        pipe.start_relay()
        args = {"order_id": CANARIES[0], "amount": CANARIES[2], "currency": "EUR", "reason": CANARIES[1]}
        keys = ("f-ok-1", "f-ok-2", "f-ok-3", "f-429", "f-lost", "f-rejected")
        ids = {k: pipe.submit(k, dict(args)).operation_id for k in keys}
        final = {k: ("failed_before_commit" if k == "f-rejected" else "succeeded") for k in keys}
        for k, op_id in ids.items():
            pipe.wait_status(op_id, final[k], timeout_s=40)
        assert pipe.op(ids["f-lost"]).status == "succeeded" and pipe.attempts(ids["f-lost"], "lookup")

        want = {"succeeded": "SUCCESS", "failed_before_commit": "FAILURE"}
        tasks = wait_for(
            lambda: (
                (t := _tasks(base, taskname=NAME))
                and all(t.get(op_id, {}).get("state") == want[final[k]] for k, op_id in ids.items())
                and t
            ),
            30,
            what=lambda: f"Flower's tasks in the ledger's states: {_states(base)}",
        )
        # Every operation under its action's name, its uuid the operation id, args: the id and tenant.
        assert set(tasks) == set(ids.values())
        for op_id in ids.values():
            task = tasks[op_id]
            assert task["name"] == NAME and op_id in task["args"] and "'t1'" in task["args"], task
            assert task["kwargs"] == "{}" and task["worker"] and task["received"] and task["started"], task
        assert tasks[ids["f-ok-1"]]["result"] and tasks[ids["f-ok-1"]]["runtime"] is not None
        assert "http_422" in tasks[ids["f-rejected"]]["exception"], tasks[ids["f-rejected"]]

        # The retried one shows its retry: the attempt before this one, when it was retried and why.
        retried = tasks[ids["f-429"]]
        assert retried["retries"] == 1 and retried["retried"] is not None, retried
        assert tap.of(ids["f-429"]).count("task-retried") == 1
        # The unknown one was OUTCOME_UNKNOWN, never FAILURE, then settled by its lookup.
        assert "task-outcome_unknown" in tap.of(ids["f-lost"]) and "task-failed" not in tap.of(ids["f-lost"])
        lookups = _tasks(base, taskname=LOOKUP)
        assert [t["state"] for t in lookups.values() if ids["f-lost"] in t["args"]] == ["SETTLED"], lookups
        assert all(t["state"] != "FAILURE" for t in lookups.values())

        # Flower's views: the tasks page's filter by name, a task's page with its history, no doorbells.
        page = _get(base, "/tasks/datatable", params=_datatable(f"name:{NAME}")).json()
        assert {t["uuid"] for t in page["data"]} == set(ids.values())
        history = _get(base, f"/task/{ids['f-429']}").text
        for field in ("Received", "Started", "Retried", "Succeeded", "Retries", "Runtime"):
            assert f"<dt>{field}</dt>" in history, field
        seen = _tasks(base)
        assert not [t for t in seen.values() if t["name"] in ("outbox.dispatch", "outbox.reconcile")]
        # The dashboard's counts per worker add up to the ledger's.
        counts = _dashboard(base)
        assert sum(w.get("task-succeeded", 0) for w in counts) == pipe.count("succeeded") == 5, counts
        assert sum(w.get("task-failed", 0) for w in counts) == pipe.count("failed_before_commit") == 1, counts

        # Not one argument of an intent in any event, nor in what Flower shows.
        shown = json.dumps(list(tap.events)) + json.dumps(seen) + json.dumps(lookups)
        for value in (*CANARIES, "f-ok-1", pk("f-429")):
            assert value not in shown, f"{value!r} leaked into the task events"
    finally:
        tap.stop()
        flower.terminate()
        flower.wait(10)


def test_flower_turns_the_calls_events_on_itself(pipe, sandbox, tmp_path):
    """A worker started without task events (no OUTBOX_TASK_EVENTS, no -E): Flower's own
    enable_events, which it repeats every 5 s, makes its calls tasks in Flower too."""
    pytest.importorskip("flower")
    assert "OUTBOX_TASK_EVENTS" not in pipe.env
    worker = pipe.start_worker("quiet", queues="dispatch")
    pipe.start_relay()
    flower, base = _start_flower(pipe, tmp_path)
    try:
        wait_for(lambda: any(worker.name in (w.get("hostname") or "") for w in _dashboard(base)), 60, what="Flower")
        submitted: list[str] = []

        def shown() -> bool:
            receipt = pipe.submit(f"after-flower-{len(submitted)}")
            submitted.append(receipt.operation_id)
            pipe.wait_status(receipt.operation_id, "succeeded")
            tasks = _tasks(base, taskname=NAME)
            return any(tasks.get(op_id, {}).get("state") == "SUCCESS" for op_id in submitted)

        wait_for(shown, 40, interval_s=0.5, what="a call shown once Flower enabled task events")
    finally:
        flower.terminate()
        flower.wait(10)


def _get(base: str, path: str, **kw: Any) -> httpx.Response:
    r = httpx.get(base + path, auth=AUTH, timeout=10, **kw)
    r.raise_for_status()
    return r


def _tasks(base: str, **params: str) -> dict[str, dict[str, Any]]:
    try:
        return dict(_get(base, "/api/tasks", params=params).json())
    except (httpx.HTTPError, ValueError):
        return {}


def _states(base: str) -> dict[str, str]:
    return {uuid: f"{t['name']}:{t['state']}" for uuid, t in _tasks(base).items()}


def _dashboard(base: str) -> list[dict[str, Any]]:
    try:
        return list(_get(base, "/workers", params={"json": "1"}).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _datatable(search: str) -> dict[str, str]:
    return {
        "draw": "1",
        "start": "0",
        "length": "100",
        "search[value]": search,
        "order[0][column]": "0",
        "columns[0][data]": "name",
        "order[0][dir]": "asc",
    }
