"""A pause per business object (issue 34, part 3; outbox/ledger/objects.py).

End to end on PostgreSQL with a real worker, the relay, Redis and the sandbox, which counts the
effects: a second refund on an order whose first refund is outcome unknown makes no effect until the
first is settled, while another order's refund flows. On both ledgers: what a refusal at submit sees,
and the hold's rules (the holder's state read after the lock decides)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from outbox.actions.rules import load_action_rules
from outbox.errors import ObjectBusy
from outbox.ledger.models import Operation
from outbox.ledger.objects import ObjectRule, release_finished, take_hold
from outbox.ledger.states import Status
from producer import submit
from tests.harness import CLOCK_LEASE, action, actions_doc, pk, wait_for

REFUND = "payments.refund.create"
ARGS = ["order_id", "amount", "currency", "reason"]


def _refund(order: str, amount: str) -> dict[str, Any]:
    return {"order_id": order, "amount": amount, "currency": "EUR", "reason": "damaged"}


@pytest.mark.postgres
@pytest.mark.redis
def test_a_second_refund_on_an_order_with_an_unknown_first_makes_no_effect_until_it_is_settled(pipe, sandbox):
    refund = action("/v1/refunds", decimal_args=["amount"], args=ARGS, object="order:{order_id}")
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund}))
    rules = load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"])
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)  # the first refund's answer is lost
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")  # and cannot be looked up
    pipe.env.update(CLOCK_LEASE)
    pipe.start_worker()
    pipe.start_relay()

    first = pipe.submit("obj-1", _refund("o-81", "10.00"), rules=rules)
    pipe.wait_status(first.operation_id, "outcome_unknown")
    assert len(sandbox.effects(key=pk("obj-1"))) == 1  # it did happen; we do not know it yet

    second = pipe.submit("obj-2", _refund("o-81", "20.00"), rules=rules)
    assert second.waiting_on is not None and second.waiting_on.operation_id == first.operation_id
    other = pipe.submit("obj-3", _refund("o-82", "30.00"), rules=rules)
    pipe.wait_status(other.operation_id, "succeeded")  # another order flows

    held = wait_for(
        lambda: (op := pipe.op(second.operation_id)).waiting_for == "object" and op,
        what=lambda: f"obj-2 sent back to wait for its object (now {pipe.op(second.operation_id).reason})",
    )
    assert held.status == "not_dispatched" and first.operation_id in (held.reason or "")
    assert held.attempt_count == 0  # waiting costs no attempt
    assert sandbox.requests(method="POST", key=pk("obj-2")) == []  # nothing reached the provider
    assert sandbox.effects(key=pk("obj-2")) == []

    sandbox.remove_fault(down["id"])
    pipe.advance_to_due(first.operation_id)  # the reconciler's next lookup, now
    pipe.wait_status(first.operation_id, "succeeded", timeout_s=20)
    pipe.wait_status(second.operation_id, "succeeded", timeout_s=30)
    found = [g for g in sandbox.requests(method="GET", key=pk("obj-1")) if g["status"] == 200]
    [sent] = sandbox.requests(method="POST", key=pk("obj-2"))
    assert found and sent["seq"] > found[0]["seq"]  # sent only after the first was found
    assert len(sandbox.effects()) == 3 and sandbox.duplicates() == []


def _rules(tmp_path: Any, busy: str = "wait", approval: bool = False) -> Any:
    import yaml

    refund = action("/v1/refunds", args=ARGS, object="order:{order_id}", when_object_busy=busy)
    if approval:
        refund["approval"] = {"required": "when", "when": "amount > 100"}
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc("http://127.0.0.1:9", actions={REFUND: refund})))
    return load_action_rules(path)


def _submit(ledger: Any, key: str, args: dict[str, Any], rules: Any) -> Any:
    with ledger.sessions.begin() as s:
        return submit(s, tenant="t1", idempotency_key=key, action=REFUND, args=args, subject="t", rules=rules)


def _set_status(ledger: Any, operation_id: str, status: Status) -> None:
    with ledger.sessions.begin() as s:  # the state alone: what the hold reads
        s.execute(update(Operation).where(Operation.id == operation_id).values(status=status.value))


def test_refuse_mode_names_the_blocking_operation_and_stores_nothing(ledger, tmp_path):
    rules = _rules(tmp_path, busy="refuse", approval=True)
    first = _submit(ledger, "r-1", _refund("o-81", "500"), rules)
    assert first.status == "awaiting_approval"
    with pytest.raises(ObjectBusy) as refused:
        _submit(ledger, "r-2", _refund("o-81", "5"), rules)
    assert refused.value.blocking_operation_id == first.operation_id and refused.value.object_key == "order:o-81"
    assert "waiting for a person's approval" in refused.value.model_message
    assert _submit(ledger, "r-1", _refund("o-81", "500"), rules).operation_id == first.operation_id  # a replay
    assert _submit(ledger, "r-3", _refund("o-82", "5"), rules).new  # another order
    with ledger.sessions() as s:
        assert s.query(Operation).filter(Operation.idempotency_key == "r-2").count() == 0
    with pytest.raises(Exception, match="args.order_id"):
        _submit(ledger, "r-4", {"amount": "5", "currency": "EUR"}, rules)


def test_the_hold_passes_one_operation_at_a_time_while_the_holders_outcome_is_not_known(ledger, tmp_path):
    rules = _rules(tmp_path, approval=True)
    a = _submit(ledger, "h-a", _refund("o-1", "5"), rules).operation_id
    b = _submit(ledger, "h-b", _refund("o-1", "6"), rules).operation_id
    lone = _submit(ledger, "h-c", _refund("o-2", "7"), rules).operation_id

    def hold(op_id: str) -> Any:
        with ledger.sessions.begin() as s:
            return take_hold(s, op_id)

    assert hold(a) is None  # the first takes the free object
    _set_status(ledger, a, Status.DISPATCHING)
    assert hold(lone) is None  # another object
    for state in (Status.DISPATCHING, Status.OUTCOME_UNKNOWN, Status.ACCEPTED, Status.RECONCILIATION_REQUIRED):
        _set_status(ledger, a, state)
        blocker = hold(b)
        assert blocker is not None and (blocker.operation_id, blocker.status) == (a, state)
    _set_status(ledger, a, Status.SUCCEEDED)
    assert hold(b) is None  # known now: b takes the object over
    _set_status(ledger, b, Status.DISPATCHING)
    _set_status(ledger, a, Status.NOT_DISPATCHED)
    assert hold(a).operation_id == b  # a retried later waits for b in turn

    later = _submit(ledger, "h-d", _refund("o-1", "500"), rules)  # needs approval: holds back what comes after
    assert later.status == "awaiting_approval" and later.waiting_on.operation_id == b
    _set_status(ledger, b, Status.SUCCEEDED)
    after = _submit(ledger, "h-e", _refund("o-1", "8"), rules).operation_id
    blocker = hold(after)
    assert blocker is not None and blocker.operation_id == later.operation_id
    assert hold(a) is None  # submitted before the approval: it does not wait for it
    _set_status(ledger, a, Status.SUCCEEDED)
    with ledger.sessions.begin() as s:  # retention drops a finished holder's hold: nothing changes
        assert release_finished(s, [a]) == 1
    assert hold(b) is None and hold(b) is None  # taken anew, then kept by its holder


def test_object_templates_are_checked_when_the_file_is_read(tmp_path):
    import yaml

    from outbox.actions.files import ActionsFileError
    from workers.provider.actions import parse_actions

    for template, said in (("order", "names no argument"), ("order:{order}", "not in args"), ("o:{a.b}", "plain")):
        refund = action("/v1/refunds", args=ARGS, object=template)
        doc = actions_doc("http://127.0.0.1:9", actions={REFUND: refund})
        with pytest.raises(ActionsFileError, match=said):
            parse_actions(doc)
        path = tmp_path / "a.yaml"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(ActionsFileError, match=said):
            load_action_rules(path)
    assert ObjectRule("order:{order_id}").render({"order_id": 81}) == "order:81"


def test_a_long_wait_looks_again_less_often():
    from outbox.ledger.objects import Blocker

    def after(status: Status, waited_s: float) -> float:
        return Blocker("op", REFUND, status, "order:o-1").recheck_s(waited_s)

    assert [after(Status.DISPATCHING, w) for w in (0, 3600)] == [1.0, 1.0]  # a call in flight ends soon
    assert [after(Status.OUTCOME_UNKNOWN, w) for w in (0, 200, 3600)] == [5.0, 20.0, 60.0]
    assert [after(Status.RECONCILIATION_REQUIRED, w) for w in (0, 600, 3600)] == [30.0, 60.0, 300.0]
