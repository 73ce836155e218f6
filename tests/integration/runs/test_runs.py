"""Multi-step runs (issue 18): steps in order, each once; resume after kill -9 at each step boundary;
compensation in reverse order, each once, also through faults; irreversible steps go to a person;
a task-level budget; an unresolved step holds only its own run; draft-then-commit; cancel.

Real Celery worker processes, the relay thread (which advances runs), PostgreSQL, Redis and the
sandbox over HTTP. Every effect is counted by the sandbox.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from outbox.errors import RunConflict
from outbox.runs.lifecycle import find_run, run_json, submit_run
from tests.harness import action, actions_doc, pk, wait_for
from tests.integration.surfaces.test_tenants import _cli

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

FINAL = {"succeeded", "failed", "compensated", "cancelled", "needs_person", "resolved"}


def _actions(pipe: Any, sandbox: Any) -> None:
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={
                "shop.order.create": action("/v1/orders"),
                "shop.stock.reserve": action("/v1/reservations"),
                "shop.cancel": action("/v1/cancellations"),
                # Irreversible: never undone by automation, so a person approves each one before it is sent.
                "ledger.accrual.post": action("/v1/tickets", irreversible=True, approval={"required": "always"}),
                "notify.email.send": action("/v1/emails"),
                "quote.draft": action("/v1/quotes", phase="draft"),
                "quote.commit": action("/v1/quote_commits", phase="commit"),
            },
        )
    )


def _rules(pipe: Any) -> Any:
    from producer.client import action_rules_for

    return action_rules_for(pipe.settings())


def _order_steps(run_key: str, *, accrual_irreversible: bool = False) -> list[dict[str, Any]]:
    undo = lambda what: {"action": "shop.cancel", "args": {"undoes": f"{run_key}:{what}"}}  # noqa: E731
    accrual: dict[str, Any] = {"name": "accrual", "action": "ledger.accrual.post"}
    accrual["args"] = {"subject": "accrual", "customer_id": "c-1"}
    if not accrual_irreversible:
        accrual = {"name": "accrual", "action": "shop.order.create", "args": {"order_ref": f"{run_key}-acc"}}
        accrual["compensate"] = undo("accrual")
    return [
        {"name": "order", "action": "shop.order.create", "args": {"order_ref": run_key}, "compensate": undo("order")},
        {
            "name": "reserve",
            "action": "shop.stock.reserve",
            "args": {"sku": "A-1", "qty": 2},
            "compensate": undo("reserve"),
        },
        accrual,
        {"name": "notify", "action": "notify.email.send", "args": {"to": "buyer@example.com", "subject": "ordered"}},
    ]


def _submit(pipe: Any, run_key: str, steps: list[dict[str, Any]], **kw: Any) -> str:
    with pipe.sessions.begin() as s:
        return submit_run(
            s, tenant="t1", run_key=run_key, steps=steps, subject="agent:buyer", rules=_rules(pipe), **kw
        ).run_id


def _run(pipe: Any, run_id: str) -> dict[str, Any]:
    with pipe.sessions() as s:
        return run_json(s, find_run(s, run_id))


def _wait_run(pipe: Any, run_id: str, *statuses: str, timeout_s: float = 40) -> dict[str, Any]:
    want = set(statuses) or FINAL
    return wait_for(
        lambda: (r := _run(pipe, run_id))["status"] in want and r,
        timeout_s,
        what=lambda: f"run {run_id} in {sorted(want)}: {json.dumps(_run(pipe, run_id), indent=1)[:3000]}",
    )


def _effects(sandbox: Any, run_key: str, step: str) -> list[dict[str, Any]]:
    return sandbox.effects(key=pk(f"{run_key}:{step}"))


def _no_state_lies(pipe: Any, sandbox: Any) -> None:
    """Every operation of the test (steps and compensations) against what the sandbox made: a state
    that says an effect happened has exactly one, a state that says none happened has none."""
    from sqlalchemy import select

    from outbox.ledger.models import Operation

    with pipe.sessions() as s:
        ops = s.execute(select(Operation.provider_key, Operation.status)).all()
    assert ops
    for key, status in ops:
        made = len(sandbox.effects(key=key))
        if status in ("succeeded", "committed_evidence_degraded"):
            assert made == 1, (key, status, made)
        else:
            assert status in ("failed_before_commit", "cancelled") and made == 0, (key, status, made)


def _seq(sandbox: Any, run_key: str, step: str) -> int:
    (effect,) = _effects(sandbox, run_key, step)
    return int(effect["seq"])


def test_steps_run_in_order_each_once_and_a_resubmission_is_the_same_run(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker()
    pipe.start_relay()
    steps = _order_steps("po-1")
    run_id = _submit(pipe, "po-1", steps, budget={"max_attempts": 20, "deadline_s": 120})
    done = _wait_run(pipe, run_id)
    assert done["status"] == "succeeded", done["reason"]
    names = [s["name"] for s in steps]
    assert all(len(_effects(sandbox, "po-1", n)) == 1 for n in names)
    # In order: each step's effect exists only after the one before it.
    assert [_seq(sandbox, "po-1", n) for n in names] == sorted(_seq(sandbox, "po-1", n) for n in names)
    assert sandbox.effects(key=pk("po-1:order:compensate")) == []
    assert done["outcome"] == "SUCCEEDED" and "do not retry" in done["model_message"]
    assert done["budget"]["used"] == 4 and done["budget"]["retries"] == 0
    # The same run again is the same run; a changed step under the same key is a conflict.
    assert _submit(pipe, "po-1", steps, budget={"max_attempts": 20, "deadline_s": 120}) == run_id
    changed = [dict(steps[0], args={"order_ref": "other"}), *steps[1:]]
    with pytest.raises(RunConflict):
        _submit(pipe, "po-1", changed, budget={"max_attempts": 20, "deadline_s": 120})
    assert len(_effects(sandbox, "po-1", "order")) == 1


@pytest.mark.parametrize("point", ["dispatch.after_claim", "dispatch.before_send", "dispatch.after_response"])
def test_kill_9_at_a_step_boundary_resumes_with_every_effect_once(pipe, sandbox, point):
    """after_claim: the worker dies holding the step's lease; before_send: as the request is about to
    leave; after_response: the provider
    committed and the worker died before the ledger recorded it (the lease runs out, the
    reconciler finds the effect). Either way the run resumes at that step, reusing the first."""
    _actions(pipe, sandbox)
    doomed = pipe.start_worker("doomed", extra_env={"OUTBOX_FAILPOINTS": f"{point}=exit@k9:reserve"})
    pipe.start_relay()
    run_id = _submit(pipe, "k9", _order_steps("k9"))
    wait_for(lambda: doomed.proc.poll() is not None, 30, what="the worker killed at the failpoint")
    pipe.start_worker("fresh")
    done = _wait_run(pipe, run_id, timeout_s=60)
    assert done["status"] == "succeeded", done["reason"]
    for name in ("order", "reserve", "accrual", "notify"):
        assert len(_effects(sandbox, "k9", name)) == 1, name
    assert len(sandbox.requests(method="POST", key=pk("k9:order"))) == 1  # reused, never re-sent
    _no_state_lies(pipe, sandbox)


def test_relay_restart_between_steps_resumes_from_the_ledger(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker()
    relay = pipe.start_relay()
    run_id = _submit(pipe, "rr", _order_steps("rr"))
    wait_for(lambda: len(_effects(sandbox, "rr", "reserve")) == 1, 30, what="step 2 done")
    relay.stop()
    pipe._relay_thread.join(10)
    pipe.start_relay()
    assert _wait_run(pipe, run_id)["status"] == "succeeded"
    assert all(len(_effects(sandbox, "rr", n)) == 1 for n in ("order", "reserve", "accrual", "notify"))


def test_step_3_rejected_compensates_1_and_2_in_reverse_once_each_through_a_fault(pipe, sandbox):
    _actions(pipe, sandbox)
    sandbox.add_fault(mode="reject_422", key_pattern=pk("cx:accrual"))
    # The first compensation's answer is lost after the provider committed it: looked up, not re-sent.
    sandbox.add_fault(mode="commit_then_drop", key_pattern=pk("cx:reserve:compensate"), count=1)
    pipe.start_worker()
    pipe.start_relay()
    run_id = _submit(pipe, "cx", _order_steps("cx"))
    done = _wait_run(pipe, run_id, timeout_s=60)
    assert done["status"] == "compensated", done["reason"]
    assert "accrual" in done["reason"] and "undone in reverse order: reserve, order" in done["reason"]
    assert _effects(sandbox, "cx", "accrual") == [] and _effects(sandbox, "cx", "notify") == []
    undo_reserve, undo_order = (
        _effects(sandbox, "cx", "reserve:compensate"),
        _effects(sandbox, "cx", "order:compensate"),
    )
    assert len(undo_reserve) == 1 and len(undo_order) == 1
    assert undo_reserve[0]["seq"] < undo_order[0]["seq"]  # reverse order
    assert len(_effects(sandbox, "cx", "order")) == len(_effects(sandbox, "cx", "reserve")) == 1
    assert done["outcome"] == "FAILED_BEFORE_COMMIT"
    assert [s["state"] for s in done["steps"]] == ["succeeded", "succeeded", "failed_before_commit", "not_sent"]
    _no_state_lies(pipe, sandbox)


def test_an_irreversible_step_and_a_later_failure_go_to_a_person_with_nothing_compensated(pipe, sandbox):
    _actions(pipe, sandbox)
    sandbox.add_fault(mode="reject_422", key_pattern=pk("irr:notify"))
    pipe.start_worker()
    pipe.start_relay()
    run_id = _submit(pipe, "irr", _order_steps("irr", accrual_irreversible=True))
    wait_for(lambda: _run(pipe, run_id)["outcome"] == "AWAITING_APPROVAL", 30, what="the accrual waits for a person")
    accrual = next(s["operation"]["operation_id"] for s in _run(pipe, run_id)["steps"] if s["name"] == "accrual")
    approved = _cli(pipe, "approvals", "approve", accrual, "--by", "alice", "--note", "accrual checked")
    assert approved.returncode == 0, approved.stderr
    done = _wait_run(pipe, run_id)
    assert done["status"] == "needs_person" and "accrual (irreversible)" in done["reason"], done["reason"]
    assert "no compensation was attempted" in done["reason"]
    assert sandbox.effects(resource="cancellations") == []
    assert done["outcome"] == "NEEDS_HUMAN"
    shown = _cli(pipe, "runs", "show", run_id)
    assert shown.returncode == 0 and "needs_person" in shown.stdout, shown.stderr
    closed = _cli(pipe, "runs", "resolve", run_id, "--by", "alice", "--note", "accrual reversed by hand, JE-17")
    assert closed.returncode == 0, closed.stderr
    assert _run(pipe, run_id)["status"] == "resolved"


def test_a_spent_run_budget_stops_further_sends_and_counts_the_retries(pipe, sandbox):
    _actions(pipe, sandbox)
    # Step 1's first two attempts are refused before commit (503): retries, billed to the run.
    sandbox.add_fault(mode="unavailable_503", key_pattern=pk("bud:order"), count=2, retry_after_s=0.2)
    pipe.start_worker()
    pipe.start_relay()
    run_id = _submit(pipe, "bud", _order_steps("bud"), budget={"max_attempts": 4})
    done = _wait_run(pipe, run_id)
    # 3 attempts for step 1 (2 retries), 1 for step 2: the budget of 4 is spent before step 3.
    assert done["status"] == "needs_person", done["reason"]
    assert "budget of 4 attempts is spent" in done["reason"] and "runs cancel" in done["reason"]
    assert done["budget"] == done["budget"] | {"used": 4, "dispatches": 4, "retries": 2, "max_attempts": 4}
    assert len(_effects(sandbox, "bud", "order")) == len(_effects(sandbox, "bud", "reserve")) == 1
    assert sandbox.requests(method="POST", key=pk("bud:accrual")) == []
    assert sandbox.requests(method="POST", key=pk("bud:notify")) == []
    # A person chooses to undo what was done: compensations in reverse order, once each.
    undone = _cli(pipe, "runs", "cancel", run_id, "--compensate", "--by", "alice")
    assert undone.returncode == 0, undone.stderr
    final = _wait_run(pipe, run_id, "cancelled")
    assert "undone in reverse order: reserve, order" in final["reason"]
    assert len(_effects(sandbox, "bud", "reserve:compensate")) == len(_effects(sandbox, "bud", "order:compensate")) == 1
    _no_state_lies(pipe, sandbox)


def test_an_unknown_step_holds_only_its_own_run(pipe, sandbox):
    _actions(pipe, sandbox)
    sandbox.add_fault(mode="commit_then_drop", key_pattern=pk("held:order"), count=1)
    pipe.start_worker("sender", queues="dispatch")  # no reconciler yet: the unknown stays unknown
    pipe.start_relay()
    held = _submit(pipe, "held", _order_steps("held"))
    wait_for(
        lambda: _run(pipe, held)["holding"] and _run(pipe, held)["holding"]["status"] == "outcome_unknown",
        30,
        what="held",
    )
    other = _submit(pipe, "flows", _order_steps("flows"))
    assert _wait_run(pipe, other)["status"] == "succeeded"  # the other run flows past
    now = _run(pipe, held)
    assert now["status"] == "running" and now["outcome"] == "UNKNOWN" and now["holding"]["step"] == "order"
    assert sandbox.requests(method="POST", key=pk("held:reserve")) == []  # nothing after the unknown step
    pipe.start_worker("reconciler", queues="outcome_unknown")
    assert _wait_run(pipe, held)["status"] == "succeeded"
    for name in ("order", "reserve", "accrual", "notify"):
        assert len(_effects(sandbox, "held", name)) == 1, name
    _no_state_lies(pipe, sandbox)


def test_drafts_then_one_commit(pipe, sandbox):
    _actions(pipe, sandbox)
    pipe.start_worker()
    pipe.start_relay()
    steps = [
        {"name": "draft", "action": "quote.draft", "args": {"quote_ref": "Q-81", "amount": "120.00"}},
        {"name": "revise", "action": "quote.draft", "args": {"quote_ref": "Q-81", "amount": "110.00"}},
        {"name": "commit", "action": "quote.commit", "args": {"quote_ref": "Q-81"}},
    ]
    ok = _run(pipe, _submit(pipe, "q-ok", steps))
    ok = _wait_run(pipe, ok["run_id"])
    assert ok["status"] == "succeeded" and len(sandbox.effects(resource="quote_commits")) == 1
    assert [s["phase"] for s in ok["steps"]] == ["draft", "draft", "commit"]
    # A refused commit leaves only drafts: nothing real to undo, the run failed with no effect.
    sandbox.add_fault(mode="reject_422", key_pattern=pk("q-no:commit"))
    bad = _wait_run(pipe, _submit(pipe, "q-no", [dict(s, args=dict(s["args"], quote_ref="Q-82")) for s in steps]))
    assert bad["status"] == "failed" and "drafts only" in bad["reason"], bad["reason"]
    assert sandbox.effects(resource="cancellations") == []


def test_cancel_with_compensation_while_a_step_waits_for_approval(pipe, sandbox):
    doc = actions_doc(
        sandbox.url,
        actions={
            "shop.order.create": action("/v1/orders"),
            "shop.cancel": action("/v1/cancellations"),
            "shop.stock.reserve": action("/v1/reservations", approval={"required": "always", "ttl_s": 60}),
        },
    )
    pipe.write_actions(doc)
    pipe.start_worker()
    pipe.start_relay()
    steps = _order_steps("ca")[:2]
    run_id = _submit(pipe, "ca", steps)
    wait_for(lambda: _run(pipe, run_id)["outcome"] == "AWAITING_APPROVAL", 30, what="step 2 waits for approval")
    out = _cli(pipe, "runs", "cancel", "ca", "--compensate", "--by", "alice")
    assert out.returncode == 0, out.stderr
    done = _wait_run(pipe, run_id, "cancelled")
    assert "undone in reverse order: order" in done["reason"], done["reason"]
    assert sandbox.requests(method="POST", key=pk("ca:reserve")) == []  # never sent
    assert len(_effects(sandbox, "ca", "order")) == len(_effects(sandbox, "ca", "order:compensate")) == 1
    listed = json.loads(_cli(pipe, "runs", "list", "--json").stdout)
    assert [r["status"] for r in listed] == ["cancelled"]


def test_runs_submit_from_a_file_names_bad_fields_and_resubmits_the_same_run(pipe, sandbox, tmp_path):
    _actions(pipe, sandbox)
    doc = {"tenant": "t1", "run_key": "file-1", "steps": _order_steps("file-1")[:2], "budget": {"max_attempts": 5}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    first = _cli(pipe, "runs", "submit", "--file", str(path))
    assert first.returncode == 0, first.stderr
    receipt = json.loads(first.stdout)
    assert receipt["new"] is True and receipt["status"] == "running"
    again = json.loads(_cli(pipe, "runs", "submit", "--file", str(path)).stdout)
    assert again["run_id"] == receipt["run_id"] and again["new"] is False
    path.write_text(json.dumps(doc | {"budget": {"max_attempts": 6}}))
    conflict = _cli(pipe, "runs", "submit", "--file", str(path))
    assert conflict.returncode == 3 and "run key 'file-1' was already used" in conflict.stderr, conflict.stderr
    for bad, field in (
        (doc | {"steps": [dict(doc["steps"][0], name="")]}, "steps[0].name"),
        (doc | {"budgets": {}}, "budgets"),
        ({"run_key": "x"}, "steps"),
    ):
        path.write_text(json.dumps(bad))
        refused = _cli(pipe, "runs", "submit", "--file", str(path))
        assert refused.returncode == 2 and f"invalid input: {field}:" in refused.stderr, refused.stderr
    missing = _cli(pipe, "runs", "show", "no-such-run")
    assert missing.returncode == 2 and "no run with id or run key" in missing.stderr
    shown = _cli(pipe, "runs", "show", "file-1", "--tenant", "t1")
    assert shown.returncode == 0 and "order" in shown.stdout and "budget: 0 of 5 attempts" in shown.stdout, shown.stdout
