"""The source articles' figures in the reconciliation report (issue 51, point 3), on a known mix made
through the real pipeline (PostgreSQL, the relay, a Celery worker, the sandbox over HTTP), read by
``agent-outbox report`` (a subprocess), the exporter and the console:

- two keys on one order, both succeeded (a caller that minted a new key on its retry): a possible
  duplicate by business object, by the action's ``object`` and by ``report.same_effect_when``;
- a key conflict (the same key, other arguments: the caller's transaction rolled back) and a same-key
  replay, counted;
- the first-time resolution ratio: settled without a second attempt or a person;
- failure attributability: only a failure that names a fault point (a status code, a transport error)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from outbox.actions.rules import load_action_rules
from outbox.errors import IdempotencyConflict
from outbox.ledger.models import Handoff
from outbox.ledger.states import Resolution
from outbox.reads.metrics import LedgerCollector
from outbox.service import handoffs
from producer.client import Outbox
from tests.harness import REFUND_ARGS, action, actions_doc, pk
from tests.integration.surfaces.test_handoffs_cli import cli
from workers.console.views import counters as console_figures

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
REFUND, TICKET = "payments.refund.create", "support.ticket.create"
ARGS = ["order_id", "amount", "currency", "reason"]


def _ticket(order: str) -> dict[str, Any]:
    return {"order_id": order, "subject": "late delivery", "customer_id": "c-1"}


def _report(pipe: Any, *extra: str) -> dict[str, Any]:
    done = cli(pipe, "report", "--json", *extra)
    assert done.returncode in (0, 1), done.stderr
    return dict(json.loads(done.stdout))


def test_the_articles_figures_on_a_known_mix(pipe, sandbox):
    refund = action("/v1/refunds", decimal_args=["amount"], args=ARGS, object="order:{order_id}")
    ticket = action(
        "/v1/tickets", args=["order_id", "subject", "customer_id"], report={"same_effect_when": ["order_id"]}
    )
    pipe.write_actions(actions_doc(sandbox.url, actions={REFUND: refund, TICKET: ticket}))
    outbox = Outbox(pipe.sessions.kw["bind"], rules=load_action_rules(pipe.env["OUTBOX_ACTIONS_FILE"]))
    sandbox.add_fault(mode="unavailable_503", method="POST", key_pattern=pk("r-4"), count=1)  # a second attempt
    sandbox.add_fault(mode="reject_422", method="POST", key_pattern=pk("r-5"))  # failed, at a status code
    sandbox.add_fault(mode="refuse_credentials", method="POST", key_pattern=pk("r-6"), count=1)  # a person

    def refund_of(key: str, order: str, **kw: Any) -> str:
        args = dict(REFUND_ARGS, order_id=order)
        return outbox.submit(tenant="t1", idempotency_key=key, action=REFUND, args=args, subject="s", **kw).operation_id

    # Failed with a reason and no fault point: its deadline passed before any attempt left.
    late = refund_of("r-late", "o-99", deadline_s=1)
    pipe.advance_ledger_clock(5, operation_ids=[late])
    ops = {
        # The article's bug: a caller retried its refund of o-81 under a new key; both succeed.
        "r-1": refund_of("r-1", "o-81"),
        "r-2": refund_of("r-2", "o-81"),
        "r-3": refund_of("r-3", "o-82"),
        "r-4": refund_of("r-4", "o-84"),
        "r-5": refund_of("r-5", "o-85"),
        "r-6": refund_of("r-6", "o-86"),
    }
    for key, order in (("t-1", "o-81"), ("t-2", "o-81"), ("t-3", "o-90")):
        ops[key] = outbox.submit(
            tenant="t1", idempotency_key=key, action=TICKET, args=_ticket(order), subject="s"
        ).operation_id
    # A same-key replay, and a key conflict (other arguments: the caller's transaction is rolled back).
    assert not outbox.submit(
        tenant="t1", idempotency_key="r-3", action=REFUND, args=dict(REFUND_ARGS, order_id="o-82"), subject="s"
    ).new
    with pytest.raises(IdempotencyConflict):
        refund_of("r-3", "o-83")

    pipe.start_worker()
    pipe.start_relay()
    for key in ("r-1", "r-2", "r-3", "r-4", "t-1", "t-2", "t-3"):
        pipe.wait_status(ops[key], "succeeded", timeout_s=30)
    pipe.wait_status(ops["r-5"], "failed_before_commit")
    pipe.wait_status(late, "failed_before_commit")
    pipe.wait_status(ops["r-6"], "reconciliation_required")
    with pipe.sessions.begin() as s:  # a person finds it was never executed: sent again, it succeeds
        handoff = s.query(Handoff).filter_by(operation_id=ops["r-6"]).one()
        handoffs.resolve(s, "t1", handoff.id, resolution=Resolution.NOT_EXECUTED, by="alice", note="checked")
    pipe.wait_status(ops["r-6"], "succeeded")
    assert len(sandbox.effects(key=pk("r-1"))) == len(sandbox.effects(key=pk("r-2"))) == 1  # two refunds, o-81

    found = _report(pipe, "--same-object-window", "1h")
    by_object = {(d["action"], d["by"]): d for d in found["possible_duplicates_by_object"]}
    assert set(by_object) == {(REFUND, "object"), (TICKET, "same_effect_when")}, found["possible_duplicates_by_object"]
    refunds = by_object[(REFUND, "object")]
    assert refunds["object"] == "order:o-81" and refunds["tenant"] == "t1" and refunds["count"] == 2
    assert sorted(o["idempotency_key"] for o in refunds["operations"]) == ["r-1", "r-2"]
    assert all(o["reference"] for o in refunds["operations"])
    tickets = by_object[(TICKET, "same_effect_when")]
    assert sorted(o["idempotency_key"] for o in tickets["operations"]) == ["t-1", "t-2"]
    assert tickets["object"].startswith("order_id (sha256:") and "o-81" not in json.dumps(tickets)  # no argument
    health = found["health"]
    assert health["possible_duplicates_by_object"] == 2
    assert (health["key_conflicts"], health["key_replays"]) == (1, 1)
    # Settled: 7 succeeded at once or after a wait, r-4 after a second attempt, r-6 by a person, r-5
    # rejected and r-late past its deadline (one attempt each, no person): 8 of 10 the first time.
    assert health["first_time_resolution"] == {"settled": 10, "first_time": 8, "ratio": 0.8}
    # r-5 names its fault point (422); r-late's failure names none (a deadline is no fault point).
    assert health["failure_attributability"] == {"operations": 2, "attributable": 1, "share": 0.5}
    assert health["by_tenant"]["t1"]["possible_duplicates_by_object"] == 2
    assert "possible_duplicates_by_object" not in found["discrepancies"]  # for review: not a discrepancy
    human = cli(pipe, "report", "--since", "1h")
    assert "possible duplicates by business object" in human.stdout and "order:o-81" in human.stdout
    assert "first-time resolution" in human.stdout and "80.0%" in human.stdout

    # The exporter and the console read the report kept in the ledger.
    registry = CollectorRegistry()
    registry.register(LedgerCollector(pipe.sessions.kw["bind"]))
    for name, value in (
        ("outbox_report_possible_duplicates_by_object", 2),
        ("outbox_report_key_conflicts", 1),
        ("outbox_report_key_replays", 1),
        ("outbox_first_time_resolution_ratio", 0.8),
        ("outbox_failure_attributability_ratio", 0.5),
    ):
        assert registry.get_sample_value(name) == value, name
    with pipe.sessions() as s:
        shown = console_figures(s, "t1")["report"]
        other = console_figures(s, "t2")["report"]
    assert shown["possible_duplicates_by_object"] == 2 and shown["first_time_resolution"] == 0.8
    assert (shown["key_conflicts"], shown["key_replays"]) == (1, 1)
    assert other["possible_duplicates_by_object"] == 0 and other["first_time_resolution"] is None  # its own only
