"""Runs over HTTP (issue 18): ``POST /v1/runs``, ``GET /v1/runs/{id}``, cancel; a real server process,
workers, relay, PostgreSQL, Redis and the sandbox, which counts the effects."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.harness import action, actions_doc, pk
from tests.integration.surfaces.test_api import _key, _serve

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _run(key: str) -> dict[str, Any]:
    return {
        "run_key": key,
        "steps": [
            {
                "name": "order",
                "action": "shop.order.create",
                "args": {"order_ref": key},
                "compensate": {"action": "shop.cancel", "args": {"undoes": key}},
            },
            {"name": "reserve", "action": "shop.stock.reserve", "args": {"sku": "A-1", "qty": 2}},
        ],
        "budget": {"max_attempts": 10, "deadline_s": 120},
    }


def test_submit_read_and_cancel_a_run_over_http(pipe, sandbox):
    acts = {
        n: action(p)
        for n, p in (
            ("shop.order.create", "/v1/orders"),
            ("shop.stock.reserve", "/v1/reservations"),
            ("shop.cancel", "/v1/cancellations"),
        )
    }
    pipe.write_actions(actions_doc(sandbox.url, actions=acts))
    pipe.start_worker()
    pipe.start_relay()
    with _serve(pipe) as api:
        key, other = _key(api.env, "acme", "submit,read"), _key(api.env, "globex", "submit,read")
        with api.client(key) as c:
            new = c.post("/v1/runs", json=_run("po-7"))
            assert new.status_code == 201, new.text
            run = new.json()
            assert run["tenant"] == "acme" and [s["idempotency_key"] for s in run["steps"]] == [
                "po-7:order",
                "po-7:reserve",
            ]
            again = c.post("/v1/runs", json=_run("po-7"))
            assert again.status_code == 200 and again.json()["run_id"] == run["run_id"]
            changed = _run("po-7")
            changed["steps"][1]["args"]["qty"] = 3
            conflict = c.post("/v1/runs", json=changed)
            assert conflict.status_code == 409 and conflict.json()["field"] == "run_key", conflict.text
            for body, field in (
                (_run("x") | {"tenant": "globex"}, "tenant"),
                (_run("x") | {"steps": [{"name": "a:b", "action": "shop.order.create", "args": {}}]}, "steps[0].name"),
                (_run("x") | {"budget": {"max_attempts": 0}}, "budget.max_attempts"),
                (_run("x") | {"colour": "red"}, "colour"),
            ):
                bad = c.post("/v1/runs", json=body)
                assert bad.status_code == 422 and bad.json()["field"] == field, (body, bad.text)

            deadline = time.monotonic() + 30
            while (shown := c.get(f"/v1/runs/{run['run_id']}").json())["status"] == "running":
                assert time.monotonic() < deadline, shown
                time.sleep(0.1)
            assert shown["status"] == "succeeded" and shown["outcome"] == "SUCCEEDED", shown
            assert len(sandbox.effects(key="acme:po-7:order")) == len(sandbox.effects(key="acme:po-7:reserve")) == 1
            finished = c.post(f"/v1/runs/{run['run_id']}/cancel", json={"compensate": False})
            assert finished.status_code == 409 and "nothing to cancel" in finished.json()["detail"]
        with api.client(other) as c:  # another tenant's run does not exist for this key
            assert c.get(f"/v1/runs/{run['run_id']}").status_code == 404
            assert c.post(f"/v1/runs/{run['run_id']}/cancel").status_code == 404
    assert sandbox.effects(key=pk("po-7:order", tenant="acme"))
