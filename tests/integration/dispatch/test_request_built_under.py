"""One request per key when the first request was never recorded (review of issue 50, finding 1).

The record of what left under a key was written only by a successful fenced finalize. A worker killed
between its send and its finalize, or frozen past its lease, left nothing on record, and the retry
was judged against the version recorded at submit: unknown for a producer without the actions file,
and the producer's copy of the file, not the worker's, in a rolling deploy (the API servers restart
first with the new file while an old worker sends). Now each attempt row says which version its
worker held, and a refused finalize still records what left.

Real processes: Celery workers, the relay, PostgreSQL, Redis and the sandbox over HTTP. The
definition changes between the attempts by ``query: {v: "2"}`` and ``decimal_args`` (``500`` becomes
``"500"`` in the body); the sandbox counts the requests under the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import select

from outbox.actions.rules import load_action_rules
from outbox.evidence.handoffs import resolve
from outbox.ledger.models import Handoff
from tests.harness import action, actions_doc, pk, wait_for
from workers.provider.actions import load_actions

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ORDERS = "/v1/orders"
ACTION = "orders.place"
ARGS = {"order_ref": "o-21", "amount_cents": 500, "note": "first"}


def _doc(sandbox: Any, *, deployed: bool, **over: Any) -> dict[str, Any]:
    """The actions file before the deploy, or after it: the same action, its request built otherwise."""
    changed = {"decimal_args": ["amount_cents"], "request": {"method": "POST", "path": ORDERS, "query": {"v": "2"}}}
    orders = action(ORDERS, args=list(ARGS), **over, **(changed if deployed else {}))
    return actions_doc(sandbox.url, actions={ACTION: orders})


def _version(path: str) -> str:
    version = load_actions(path).action_version(ACTION)
    assert version is not None
    return version


def _deploy(pipe: Any, sandbox: Any, **over: Any) -> str:
    """Stop the workers, deploy the changed file, start a worker again; the new version."""
    for worker in pipe.workers:
        worker.stop()
    pipe.write_actions(_doc(sandbox, deployed=True, **over))
    pipe.start_worker()
    return _version(pipe.env["OUTBOX_ACTIONS_FILE"])


def _posts(sandbox: Any, key: str) -> list[dict[str, Any]]:
    return sorted(sandbox.requests(method="POST", key=pk(key)), key=lambda e: e["seq"])


def _handoff(pipe: Any, operation_id: str) -> Handoff:
    with pipe.sessions() as s:
        found = s.execute(select(Handoff).where(Handoff.operation_id == operation_id)).scalar_one()
        s.expunge(found)
        return found


def _killed_after_the_send(pipe: Any, sandbox: Any, key: str) -> None:
    """The first request leaves (the provider answers 500 before doing anything, which nobody will
    know) and its worker dies before its finalize: nothing on record."""
    dying = pipe.start_worker(extra_env={"OUTBOX_FAILPOINTS": f"dispatch.after_response=exit@{key}"})
    pipe.start_relay()
    wait_for(lambda: dying.proc.poll() is not None, 20, what="the worker to die after the response")


def _retried(pipe: Any, op_id: str) -> Any:
    """Its lease runs out, the lookup finds nothing (authoritative past settle_s): sent again, if it can be."""
    assert [a.attempt_class for a in pipe.attempts(op_id, "dispatch")] == ["pending"]
    assert pipe.op(op_id).request_version is None
    pipe.advance_ledger_clock(pipe.lease_s + 5, operation_ids=[op_id])
    return pipe.wait_status(op_id, "reconciliation_required", "succeeded", timeout_s=30)


def test_without_a_version_at_submit_a_lost_first_request_is_not_rebuilt_under_another_definition(pipe, sandbox):
    """A producer without the actions file records no version at submit. The first request left under
    the old definition, its worker was killed before recording it, the new definition was deployed:
    nothing different is sent under the key, a person is told both versions."""
    key = "k-built-under-null"
    pipe.write_actions(_doc(sandbox, deployed=False))
    old = _version(pipe.env["OUTBOX_ACTIONS_FILE"])
    sandbox.add_fault(mode="fail_before_commit", method="POST", path=ORDERS, count=1)
    op_id = pipe.submit(key, dict(ARGS), action=ACTION).operation_id  # producer.submit without rules
    assert pipe.op(op_id).action_version is None
    _killed_after_the_send(pipe, sandbox, key)

    current = _deploy(pipe, sandbox)
    assert current != old
    op = _retried(pipe, op_id)

    posts = _posts(sandbox, key)
    assert len(posts) == 1, f"another request went out under the key: {[(p['query'], p['body']) for p in posts]}"
    assert op.status == "reconciliation_required" and op.waiting_for == "request"
    reason = _handoff(pipe, op_id).reason
    assert f"first request sent under {old} (not on record" in reason, reason
    assert f"current {current}" in reason and "submitted under unknown" in reason
    assert [a.action_version for a in pipe.attempts(op_id, "dispatch")] == [old, current]


def test_in_a_rolling_deploy_a_lost_first_request_is_not_rebuilt_under_the_producers_newer_definition(pipe, sandbox):
    """The API servers restarted first with the new file (the version at submit is the new one); an
    old worker sent the first request under the old file and was killed by the deploy; a new worker
    finds "submitted under" equal to its own version, yet must not build a new request under the key.
    A person who finds nothing at the provider resolves "not executed": then it is built anew."""
    key = "k-built-under-rolling"
    new_file = Path(pipe.tmp) / "actions-new.yaml"
    new_file.write_text(yaml.safe_dump(_doc(sandbox, deployed=True), sort_keys=False))
    rules = load_action_rules(str(new_file))
    pipe.write_actions(_doc(sandbox, deployed=False))  # the workers' file: still the old one
    old = _version(pipe.env["OUTBOX_ACTIONS_FILE"])
    sandbox.add_fault(mode="fail_before_commit", method="POST", path=ORDERS, count=1)
    op_id = pipe.submit(key, dict(ARGS), action=ACTION, rules=rules).operation_id
    submitted = pipe.op(op_id).action_version
    assert submitted == _version(str(new_file)) != old
    _killed_after_the_send(pipe, sandbox, key)

    current = _deploy(pipe, sandbox)
    assert current == submitted
    op = _retried(pipe, op_id)

    assert len(_posts(sandbox, key)) == 1, "the new worker built another request under the key"
    assert op.status == "reconciliation_required"
    handoff = _handoff(pipe, op_id)
    assert f"submitted under {submitted}" in handoff.reason
    assert f"first request sent under {old} (not on record" in handoff.reason and f"current {current}" in handoff.reason

    with pipe.sessions.begin() as s:
        found = s.get(Handoff, handoff.id)
        assert found is not None
        resolve(s, found, resolution="not-executed", by="ops", note="no order o-21 at the provider")
    op = pipe.wait_status(op_id, "succeeded")
    first, again = _posts(sandbox, key)
    assert first["query"] == "" and again["query"] == "v=2" and json.loads(again["body"])["amount_cents"] == "500"
    assert len(sandbox.effects(key=pk(key))) == 1


def test_a_worker_frozen_past_its_lease_still_records_what_it_sent_and_the_retry_sends_it_exactly(pipe, sandbox):
    """The worker froze between the provider's answer and its finalize, past its lease: the sweep took
    the operation from it, so its finalize is refused; what it sent is recorded all the same (nothing
    was on record). A deploy later, the retry under the key is that request again, not the new one."""
    key = "k-built-under-frozen"
    slow_lookup = {"settle_s": 30}  # the lookup waits for the test's clock before it proves anything
    pipe.write_actions(_doc(sandbox, deployed=False, **slow_lookup))
    sandbox.add_fault(mode="fail_before_commit", method="POST", path=ORDERS, count=1)
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    op_id = pipe.submit(key, dict(ARGS), action=ACTION, rules=rules).operation_id
    pipe.start_worker(extra_env={"OUTBOX_FAILPOINTS": f"dispatch.after_response=sleep:6@{key}"})
    pipe.start_relay()
    wait_for(lambda: len(_posts(sandbox, key)) == 1, 20, what="the first request")
    pipe.advance_ledger_clock(pipe.lease_s + 1, operation_ids=[op_id])  # its lease runs out meanwhile
    wait_for(lambda: pipe.op(op_id).status != "dispatching", 20, what="the sweep to take it from the worker")
    first = wait_for(
        lambda: (a := pipe.attempts(op_id, "dispatch")[0]).ended_at is not None and a, 20, what="the late finalize"
    )
    assert first.stale, "its finalize came after its lease: refused"
    op = pipe.op(op_id)
    assert op.request_method == "POST" and op.request_digest == first.request_digest, "recorded all the same"
    assert op.request_key_header == "idempotency-key", "and the header its key went in"

    _deploy(pipe, sandbox, **slow_lookup)
    pipe.advance_ledger_clock(60, operation_ids=[op_id])  # settle_s passes: "not found" proves it
    op = pipe.wait_status(op_id, "succeeded", "reconciliation_required", timeout_s=30)
    assert op.status == "succeeded", op.reason
    sent, again = _posts(sandbox, key)  # the sandbox failed the first before reading its body
    assert (
        (again["method"], again["path"], again["query"])
        == (sent["method"], sent["path"], sent["query"])
        == (
            "POST",
            ORDERS,
            "",
        )
    )
    assert json.loads(again["body"])["amount_cents"] == 500, "the first request's body, not the new mapping's"
    digests = [a.request_digest for a in pipe.attempts(op_id, "dispatch")]
    assert len(digests) == 2 and digests[0] == digests[1] == op.request_digest
    assert len(sandbox.effects(key=pk(key))) == 1
