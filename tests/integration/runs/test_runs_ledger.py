"""Runs on the ledger itself, on both backends (the embedded SQLite default and PostgreSQL): the run
row and its first step in one transaction, budget caps handed to each step, and retention.

Step outcomes are written here as a worker's finalize would leave them; the pipeline with real
workers and the sandbox is tests/integration/runs/test_runs.py."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from outbox.errors import RunConflict
from outbox.ledger.models import Operation, Run
from outbox.privacy.retention import purge
from outbox.runs.advance import advance_due
from outbox.runs.lifecycle import find_run, run_json, submit_run

STEPS = [
    {
        "name": "a",
        "action": "shop.order.create",
        "args": {"order_ref": "r-1"},
        "compensate": {"action": "shop.cancel", "args": {"undoes": "a"}},
    },
    {"name": "b", "action": "shop.stock.reserve", "args": {"sku": "S"}},
]


def _submit(ledger, **kw):
    with ledger.sessions.begin() as s:
        return submit_run(s, tenant="t1", run_key="r-1", steps=STEPS, subject="agent:x", **kw)


def _settle(ledger, key: str, status: str) -> None:
    with ledger.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.idempotency_key == key).values(status=status, reason="test"))


def test_a_run_and_its_first_step_commit_together_and_later_steps_get_what_is_left(ledger):
    receipt = _submit(ledger, budget={"max_attempts": 5, "deadline_s": 300}, priority=4)
    assert receipt.new and _submit(ledger, budget={"max_attempts": 5, "deadline_s": 300}) == receipt.__class__(
        **(receipt.as_dict() | {"new": False})
    )
    with pytest.raises(RunConflict):
        _submit(ledger, budget={"max_attempts": 6, "deadline_s": 300})
    with ledger.sessions() as s:
        first = s.execute(select(Operation).where(Operation.idempotency_key == "r-1:a")).scalar_one()
        assert (first.run_id, first.max_attempts, first.provider_key) == (receipt.run_id, 5, "t1:r-1:a")
        assert first.priority == 4  # the run's, for every step
        assert s.execute(select(Operation).where(Operation.idempotency_key == "r-1:b")).first() is None
    _settle(ledger, "r-1:a", "succeeded")
    assert advance_due(ledger.sessions) == 1
    with ledger.sessions() as s:
        second = s.execute(select(Operation).where(Operation.idempotency_key == "r-1:b")).scalar_one()
        assert second.max_attempts == 5 and second.deadline_at is not None  # no attempt reached the provider yet
        assert second.priority == 4
        doc = run_json(s, find_run(s, "r-1"))
        assert doc["holding"]["step"] == "b" and doc["outcome"] == "PENDING"
    assert advance_due(ledger.sessions) == 0  # nothing to do while step b is not settled


def test_a_rolled_back_submit_leaves_neither_run_nor_step(ledger):
    with pytest.raises(RuntimeError), ledger.sessions.begin() as s:
        submit_run(s, tenant="t1", run_key="r-1", steps=STEPS, subject="agent:x")
        raise RuntimeError("the agent's own transaction failed")
    with ledger.sessions() as s:
        assert s.execute(select(Run)).first() is None and s.execute(select(Operation)).first() is None


def test_retention_purges_finished_runs_arguments_and_keeps_their_story(ledger):
    _submit(ledger)
    _settle(ledger, "r-1:a", "succeeded")
    advance_due(ledger.sessions)
    _settle(ledger, "r-1:b", "succeeded")
    advance_due(ledger.sessions)
    with ledger.sessions() as s:
        assert find_run(s, "r-1").status == "succeeded"
    assert purge(ledger.sessions, older_than_s=3600).runs == 0  # finished just now: kept
    result = purge(ledger.sessions, older_than_s=-1)
    assert result.runs == 1
    with ledger.sessions() as s:
        run = find_run(s, "r-1")
        assert run.purged_at is not None and '"order_ref"' not in (run.steps or "") and '"r-1"' not in (run.steps or "")
        assert [st["name"] for st in run_json(s, run)["steps"]] == ["a", "b"]
    assert purge(ledger.sessions, older_than_s=-1).runs == 0


def test_a_late_success_contradicting_a_failed_step_sends_the_ended_run_to_a_person(ledger):
    """Step a's request is claimed and the worker freezes; the provider's lookup lists it as failed, so
    the step ends failed_before_commit and the run ends failed. Then the frozen request lands: the run
    no longer says "nothing of it was done", a person decides."""
    from outbox.errors import StaleFence
    from outbox.evidence.late_successes import apply_unapplied
    from outbox.evidence.settlement import settle_if_fenced
    from outbox.evidence.sinks import EvidenceSink
    from outbox.ledger.claims import claim_due, claim_unknown
    from outbox.ledger.clock import db_now
    from outbox.ledger.leases import expire_leases
    from outbox.ledger.states import AttemptClass, Status
    from outbox.ledger.transitions import AttemptReport, finalize_if_fenced

    _submit(ledger)
    with ledger.sessions.begin() as s:
        [frozen] = claim_due(s, worker="zombie", lease_s=30)
        s.execute(update(Operation).where(Operation.id == frozen.operation_id).values(lease_expires_at=db_now(-1)))
    with ledger.sessions.begin() as s:
        expire_leases(s)
    with ledger.sessions.begin() as s:
        [r] = claim_unknown(s, worker="reconciler", lease_s=30, operation_id=frozen.operation_id)
    with ledger.sessions.begin() as s:
        report = AttemptReport(AttemptClass.REJECTED, status_code=404)
        settle_if_fenced(s, r, report, to=Status.FAILED_BEFORE_COMMIT, reason="listed as failed")
    advance_due(ledger.sessions)
    with ledger.sessions() as s:
        ended = run_json(s, find_run(s, "r-1"))
    assert ended["status"] == "failed" and ended["outcome"] == "FAILED_BEFORE_COMMIT"

    with ledger.sessions.begin() as s, pytest.raises(StaleFence):  # the frozen request lands
        success = AttemptReport(AttemptClass.SUCCEEDED, status_code=201, provider_reference="or_late")
        finalize_if_fenced(s, frozen, success, to=Status.SUCCEEDED, reason="2xx")
    apply_unapplied(ledger.sessions, actor="sweep", sink=EvidenceSink(None), packet=lambda s, op, why: {"why": why})
    with ledger.sessions() as s:
        flagged = run_json(s, find_run(s, "r-1"))
    assert flagged["status"] == "needs_person" and flagged["outcome"] == "NEEDS_HUMAN", flagged["reason"]
    assert "r-1:a was contradicted by the provider" in flagged["reason"]
    assert flagged["history"][-1]["actor"] == "sweep"


def test_a_person_resolves_a_run_held_by_a_step_waiting_for_one_and_no_other(ledger):
    from outbox.errors import RunNotMovable
    from outbox.runs.lifecycle import resolve_run

    _submit(ledger)
    with ledger.sessions.begin() as s, pytest.raises(RunNotMovable):
        resolve_run(s, find_run(s, "r-1"), actor="alice", note="nothing to do")  # it moves by itself
    _settle(ledger, "r-1:a", "reconciliation_required")  # e.g. its handoff was closed as abandoned
    assert advance_due(ledger.sessions) == 0  # held, for good unless a person acts
    with ledger.sessions.begin() as s:
        resolve_run(s, find_run(s, "r-1"), actor="alice", note="checked at the provider: order r-1 exists, kept")
    with ledger.sessions() as s:
        done = run_json(s, find_run(s, "r-1"))
    assert done["status"] == "resolved" and done["resolved_by"] == "alice" and "kept" in done["note"]


def test_a_plain_intent_never_becomes_a_runs_step_nor_a_step_a_plain_intent(ledger):
    from outbox.errors import KeySpaceConflict
    from producer import submit

    # A plain intent holds the key a run would derive for its first step, with the same arguments.
    with ledger.sessions.begin() as s:
        plain = submit(
            s,
            tenant="t1",
            idempotency_key="r-1:a",
            action="shop.order.create",
            args={"order_ref": "r-1"},
            subject="agent:x",
        )
    with pytest.raises(KeySpaceConflict, match="plain intent"):
        _submit(ledger)
    with ledger.sessions() as s:
        assert s.execute(select(Run)).first() is None  # refused whole: no run, no step adopted
        assert s.get(Operation, plain.operation_id).key_space == "intent"
    # The other way: a run's step key never answers a plain submit.
    with ledger.sessions.begin() as s:
        submit_run(s, tenant="t1", run_key="r-2", steps=STEPS, subject="agent:x")
    with pytest.raises(KeySpaceConflict, match="run's step"), ledger.sessions.begin() as s:
        submit(
            s,
            tenant="t1",
            idempotency_key="r-2:a",
            action="shop.order.create",
            args={"order_ref": "r-1"},
            subject="agent:x",
        )
    # A plain intent that takes a later step's key after the run began holds the run for a person
    # when the run gets there; it is never sent as the step.
    with ledger.sessions.begin() as s:
        later = submit(
            s, tenant="t1", idempotency_key="r-2:b", action="shop.stock.reserve", args={"sku": "S"}, subject="agent:x"
        )
    _settle(ledger, "r-2:a", "succeeded")
    advance_due(ledger.sessions)
    with ledger.sessions() as s:
        run = find_run(s, "r-2")
        assert run.status == "needs_person" and "plain intent" in run.reason, run.reason
        assert s.get(Operation, later.operation_id).run_id is None
