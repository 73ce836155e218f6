"""A run cancelled while its step is in flight, the step then succeeding late (docs/how-to/runs.md, Cancel).

A request already on its way cannot be called back. Step 1 is in flight when ``runs cancel`` runs:
either its worker passed every check before the send (cancel included) and is frozen (SIGSTOP) as
the request is about to leave, so the request reaches the provider after the cancel; or the request
is at the provider, which takes its time, and the worker is frozen waiting for the answer, so the
answer is read after the cancel. The cancel must stop what was not sent (step 2, never sent), keep
the late success (recorded as succeeded, never dropped) and, with ``--compensate``, undo it with the
rest. Counted at the sandbox.

Real Celery worker processes, the relay thread (which advances runs), PostgreSQL, Redis, the CLI and
the sandbox over HTTP.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from outbox.ledger.history import HistoryEvent
from outbox.ledger.states import EventKind, Status
from tests.harness import CLOCK_LEASE, action, actions_doc, wait_for
from tests.integration.runs.test_runs import _run, _wait_run
from tests.integration.surfaces.test_tenants import _cli

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def _steps(run_key: str) -> list[dict[str, Any]]:
    undo = lambda what: {"action": "shop.cancel", "args": {"undoes": f"{run_key}:{what}"}}  # noqa: E731
    return [
        {"name": "order", "action": "shop.order.create", "args": {"order_ref": run_key}, "compensate": undo("order")},
        {
            "name": "reserve",
            "action": "shop.stock.reserve",
            "args": {"sku": "A-1", "qty": 2},
            "compensate": undo("reserve"),
        },
    ]


def _step_op(pipe: Any, run_id: str, name: str) -> dict[str, Any] | None:
    step = next(s for s in _run(pipe, run_id)["steps"] if s["name"] == name)
    brief: dict[str, Any] | None = step["operation"]
    return brief


@pytest.mark.parametrize(
    "where,compensate",
    [("before_send", True), ("before_send", False), ("at_provider", True)],
    ids=["leaving-compensate", "leaving-keep", "at-provider-compensate"],
)
def test_a_step_in_flight_at_cancel_keeps_its_late_success_and_nothing_after_it_is_sent(
    pipe, sandbox, where, compensate
):
    from outbox.runs.lifecycle import submit_run
    from producer.client import action_rules_for

    run_key = f"late-{where.replace('_', '-')}-{'comp' if compensate else 'keep'}"
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            # Longer than the worker is frozen waiting for the provider's answer: the answer, not a
            # read timeout, is what it finds when thawed.
            timeout_s=10,
            actions={
                "shop.order.create": action("/v1/orders"),
                "shop.stock.reserve": action("/v1/reservations"),
                "shop.cancel": action("/v1/cancellations"),
            },
        )
    )
    # The step is frozen far shorter than this lease: it stays the owner's, in flight, throughout.
    # The time limits only make room for the target's timeout (soft < hard < lease).
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_SOFT_TIME_LIMIT_S": "15", "OUTBOX_TIME_LIMIT_S": "20"})
    if where == "before_send":
        # Step 1 pauses after its last check, as its request is about to leave, long enough to be
        # frozen there. The glob leaves room for a prefix to the derived step key, and spares the
        # compensation.
        worker = pipe.start_worker(extra_env={"OUTBOX_FAILPOINTS": f"dispatch.before_send=sleep:1.5@*{run_key}:order"})
    else:
        # The provider works on step 1 for a second before it commits and answers.
        sandbox.add_fault(mode="latency", latency_ms=1000, method="POST", path="/v1/orders", count=1)
        worker = pipe.start_worker()
    pipe.start_relay()
    with pipe.sessions.begin() as s:
        run_id = submit_run(
            s,
            tenant="t1",
            run_key=run_key,
            steps=_steps(run_key),
            subject="agent:buyer",
            rules=action_rules_for(pipe.settings()),
        ).run_id

    step1 = wait_for(
        lambda: (
            (brief := _step_op(pipe, run_id, "order")) is not None
            and (op := pipe.op(brief["operation_id"])).status == Status.DISPATCHING.value
            and op.lease_owner is not None
            and op.lease_owner.endswith(f":{worker.pid}")
            and (where == "before_send" or sandbox.requests(method="POST"))
            and op
        ),
        15,
        interval_s=0.02,
        what="step 1 in flight",
    )
    worker.freeze()
    posts_at_cancel = 0 if where == "before_send" else 1
    try:
        # In flight: claimed and checked, not yet at the provider (before_send), or at the provider.
        assert len(sandbox.requests(method="POST")) == posts_at_cancel
        args = ["runs", "cancel", run_id, "--by", "alice"] + (["--compensate"] if compensate else [])
        done = _cli(pipe, *args)
        assert done.returncode == 0, done.stderr
        # The cancel could not stop the step: the flag is kept, the step stays in flight.
        op = pipe.op(step1.id)
        assert op.status == Status.DISPATCHING.value and op.cancel_requested is True
        run = _run(pipe, run_id)
        assert run["status"] == "running" and run["cancel_requested"] is True
        assert run["holding"]["step"] == "order"
        assert len(sandbox.requests(method="POST")) == posts_at_cancel
    finally:
        worker.thaw()

    final = _wait_run(pipe, run_id, "cancelled", "compensated", "needs_person", "failed", "succeeded")
    op = pipe.op(step1.id)
    # The late success is recorded as what it is, after the cancel request, not dropped.
    assert op.status == Status.SUCCEEDED.value and op.cancel_requested is True, (op.status, op.reason)
    assert "completed after cancel requested" in (op.reason or ""), op.reason  # DESIGN.md: said, never dropped
    with pipe.sessions() as s:
        events = list(
            s.execute(
                select(HistoryEvent.event, HistoryEvent.to_status)
                .where(HistoryEvent.operation_id == step1.id)
                .order_by(HistoryEvent.id)
            ).all()
        )
    kinds = [e for e, _ in events]
    asked = kinds.index(EventKind.CANCEL_REQUESTED.value)
    assert any(to == Status.SUCCEEDED.value for _, to in events[asked + 1 :]), events

    # Its own answer settled it (read after the cancel), not a lookup after a timeout.
    [att] = pipe.attempts(step1.id, "dispatch")
    assert (att.status_code, att.attempt_class) == (200, "succeeded") and pipe.attempts(step1.id, "lookup") == []
    # Counted at the provider: step 1 once, step 2 never sent; its compensation once if asked.
    [effect] = sandbox.effects(key=op.provider_key)
    assert op.result_reference == effect["object_id"]
    assert len(sandbox.requests(method="POST", path="/v1/orders")) == 1
    assert sandbox.requests(method="POST", path="/v1/reservations") == []
    undone = sandbox.effects(resource="cancellations")
    assert sandbox.duplicates() == []
    steps = {s["name"]: s for s in final["steps"]}
    assert steps["reserve"]["operation"] is None and steps["reserve"]["state"] == "not_sent"
    # A run cancelled with compensation ends cancelled (outbox/ledger/run_states.py), its steps undone.
    assert final["status"] == "cancelled", final["reason"]
    if compensate:
        comp = steps["order"]["compensation"]["operation"]
        assert comp["status"] == Status.SUCCEEDED.value and comp["provider_key"].endswith(f"{run_key}:order:compensate")
        assert [(e["idempotency_key"], e["object_id"]) for e in undone] == [
            (comp["provider_key"], comp["result_reference"])
        ]
        assert "undone in reverse order: order" in final["reason"], final["reason"]
    else:
        assert undone == []
        assert steps["order"]["compensation"]["operation"] is None
        assert "completed steps kept" in final["reason"] and "order" in final["reason"], final["reason"]
