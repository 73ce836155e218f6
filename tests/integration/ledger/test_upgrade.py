"""Upgrades keep working: a ledger made by the previous schema revision, with operations in the
states they can be in, upgrades with the migration and then settles as the design says.

The rows are written by today's ledger calls at head and the schema is then taken back to the
previous revision (alembic downgrade drops what later revisions added, values included): what is
left is what the previous code wrote, and the upgrade must derive the rest.

Migration 0004 (waiting_for) reads the reason text once: a row parked by an open breaker must
still be woken by a breaker reset after the upgrade. Every state an operation can be in while no
worker runs is there: not yet sent, parked by the breaker, leased (its worker died in the
upgrade), parked unknown, waiting for a person, finished; each finishes under today's code.

Migration 0003 (late evidence) adds ``attempts.applied_at``. An operation that ended
failed_before_commit before the upgrade while a stale success sat on its attempt row (issue 12)
is then found by the first sweep and handed to a person; a stale success beside a success is
only stamped.

Migration 0011 renames every table (``outbox_...``). From 4cd0727's schema (0009), real workers
first leave work in flight (a lease held by a worker that died mid-call, parked unknown, a handoff,
an approval waiting, a run between two steps) and stop; after the upgrade today's workers, the
relay and the people settle all of it, and the sandbox counts every effect exactly once.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, select, update

from outbox import migrate
from outbox.actions.rules import load_action_rules
from outbox.errors import StaleFence
from outbox.evidence.late_successes import CONTRADICTION_EVENT, apply_unapplied
from outbox.evidence.settlement import resolve_by_person, settle_if_fenced
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.claims import claim_due, claim_unknown
from outbox.ledger.clock import db_now
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.history import HistoryEvent
from outbox.ledger.leases import expire_leases
from outbox.ledger.models import ATTEMPTS, Handoff, Operation
from outbox.ledger.states import AttemptClass, Status, WaitingFor
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.ledger.waits import park_for_breaker, wake_breaker_waits
from outbox.runs.advance import advance_due
from outbox.runs.lifecycle import find_run, submit_run
from producer import submit
from tests.conftest import scratch_pg_database
from tests.harness import CLOCK_LEASE, action, actions_doc, pipeline, pk, wait_for
from tests.integration.surfaces.test_tenants import _cli

PREVIOUS = "0002"


@pytest.fixture(params=["sqlite", "postgres"])
def old_ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database at the previous revision, of its own (the session databases are at head)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
        engine = make_engine(url)
        migrate.upgrade(engine)
        engine.dispose()
        yield url
        return
    with scratch_pg_database(f"outbox_test_upgrade_{uuid.uuid4().hex[:10]}") as url:
        yield url


def _intent(key: str) -> dict[str, Any]:
    return dict(
        tenant="acme",
        idempotency_key=key,
        action="payments.refund.create",
        args={"order_id": key, "amount": Decimal("5.00"), "currency": "EUR"},
        subject="agent:bot",
    )


def test_a_ledger_of_the_previous_revision_upgrades_and_settles(old_ledger_url):
    engine = make_engine(old_ledger_url)
    sessions = make_sessionmaker(engine)
    try:
        with sessions.begin() as s:
            victim = submit(s, **_intent("victim")).operation_id
            done = submit(s, **_intent("done")).operation_id
            waiting = submit(s, **_intent("waiting")).operation_id
            parked = submit(s, **_intent("parked"), delay_s=0).operation_id
            unknown = submit(s, **_intent("unknown"), delay_s=3600).operation_id
            person = submit(s, **_intent("person"), delay_s=3600).operation_id
            leased = submit(s, **_intent("leased"), delay_s=3600).operation_id
            backoff = submit(s, **_intent("backoff"), delay_s=3600).operation_id
            told = submit(s, **_intent("told"), delay_s=3600).operation_id
            approval = submit(s, **_intent("approval"), requires_approval=True).operation_id
        with sessions.begin() as s:
            # Due now, one by one (the others wait an hour, so the batch claims below skip them).
            mine = [unknown, person, leased, backoff, told]
            s.execute(update(Operation).where(Operation.id.in_(mine)).values(next_attempt_at=db_now(-1)))
            held = {c.operation_id: c for c in claim_due(s, worker="old", lease_s=30, operation_ids=mine, limit=5)}
        for op_id, retry_after, reason in (
            (backoff, None, "503; attempt 2/5 after 3600s"),
            (told, 3600.0, "503; attempt 2/5 after 3600s (Retry-After)"),
        ):
            # Retries scheduled an hour ahead: on our backoff, and on the provider's Retry-After.
            with sessions.begin() as s:
                report = AttemptReport(AttemptClass.NOT_PROCESSED, status_code=503, retry_after_s=retry_after)
                finalize_if_fenced(s, held[op_id], report, to=Status.NOT_DISPATCHED, reason=reason, delay_s=3600)
        with sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id.in_([unknown, person])).values(lease_expires_at=db_now(-1)))
        with sessions.begin() as s:
            assert sorted(expire_leases(s)) == sorted([unknown, person])
        with sessions.begin() as s:
            # Waiting for a person: the reconciler gave up on it.
            [r] = claim_unknown(s, worker="reconciler", lease_s=30, operation_id=person)
            settle_if_fenced(
                s, r, AttemptReport(AttemptClass.AMBIGUOUS), to=Status.RECONCILIATION_REQUIRED, reason="budget spent"
            )
        with sessions.begin() as s:
            assert park_for_breaker(s, parked, delay_s=3600, reason="breaker open: parked", actor="w")
            # Not due for an hour: the claims below leave it alone.
        with sessions.begin() as s:
            zombies = {c.operation_id: c for c in claim_due(s, worker="zombie", lease_s=30, limit=2)}
            s.execute(update(Operation).where(Operation.id.in_(list(zombies))).values(lease_expires_at=db_now(-1)))
        assert set(zombies) == {victim, done}
        with sessions.begin() as s:
            assert sorted(expire_leases(s)) == sorted([victim, done])
        # The victim: the provider listed the key as failed; the done one: found at the provider.
        for op_id, to, klass in (
            (victim, Status.FAILED_BEFORE_COMMIT, AttemptClass.REJECTED),
            (done, Status.SUCCEEDED, AttemptClass.SUCCEEDED),
        ):
            with sessions.begin() as s:
                [r] = claim_unknown(s, worker="reconciler", lease_s=30, operation_id=op_id)
                settle_if_fenced(s, r, AttemptReport(klass, provider_reference="re_found"), to=to, reason="lookup")
        # Then both frozen workers wake up with the provider's 2xx: evidence on stale attempt rows.
        for c in zombies.values():
            with sessions.begin() as s:
                with pytest.raises(StaleFence):
                    finalize_if_fenced(
                        s,
                        c,
                        AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_found"),
                        to=Status.SUCCEEDED,
                        reason="2xx",
                    )
        migrate.downgrade(engine, PREVIOUS)
        assert migrate.current_revision(engine) == PREVIOUS
        assert "waiting_for" not in {c["name"] for c in inspect(engine).get_columns("operations")}
    finally:
        engine.dispose()

    engine = make_engine(old_ledger_url)  # a new process, after `agent-outbox migrate`
    sessions = make_sessionmaker(engine)
    try:
        migrate.upgrade(engine)
        assert migrate.current_revision(engine) == migrate.head_revision()
        assert "applied_at" in {c["name"] for c in inspect(engine).get_columns(ATTEMPTS)}
        moved = apply_unapplied(
            sessions, actor="sweep", sink=EvidenceSink(None), packet=lambda s, op, why: {"why": why}
        )
        assert moved == {victim: Status.RECONCILIATION_REQUIRED}
        with sessions() as s:
            ops = {op.id: op for op in s.execute(select(Operation)).scalars()}
            flagged = (
                s.execute(select(HistoryEvent.operation_id).where(HistoryEvent.event == CONTRADICTION_EVENT))
                .scalars()
                .all()
            )
        assert ops[victim].status == "reconciliation_required" and flagged == [victim]
        assert ops[done].status == "succeeded"
        # Not yet sent: claimed and finished by today's code as usual.
        with sessions.begin() as s:
            [c] = claim_due(s, worker="new", lease_s=30, operation_id=waiting)
        with sessions.begin() as s:
            finalize_if_fenced(
                s,
                c,
                AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_new"),
                to=Status.SUCCEEDED,
                reason="2xx",
            )
        with sessions() as s:
            assert s.get(Operation, waiting).status == "succeeded"
            assert s.get(Operation, parked).waiting_for == WaitingFor.BREAKER
        with sessions() as s:
            ops = {o: s.get(Operation, o) for o in (unknown, person, leased)}
        assert ops[unknown].status == "outcome_unknown" and ops[unknown].waiting_for == WaitingFor.LOOKUP
        assert ops[person].status == "reconciliation_required" and ops[person].waiting_for is None
        assert ops[leased].status == "dispatching" and ops[leased].lease_owner == "old"
        with sessions() as s:
            waits = {o: s.get(Operation, o).waiting_for for o in (backoff, told, approval, waiting)}
        assert waits == {
            backoff: WaitingFor.BACKOFF,
            told: WaitingFor.RETRY_AFTER,
            approval: WaitingFor.APPROVAL,
            waiting: None,  # finished above; before that it was due, waiting for nothing
        }
        # Parked unknown: the reconciler settles it by a lookup.
        with sessions.begin() as s:
            [r] = claim_unknown(s, worker="new-reconciler", lease_s=30, operation_id=unknown)
            settle_if_fenced(
                s,
                r,
                AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_u"),
                to=Status.SUCCEEDED,
                reason="found",
            )
        # Leased by a worker of the previous release that died in the upgrade: its lease runs out,
        # the sweep parks it in outcome_unknown, a lookup settles it.
        with sessions.begin() as s:
            s.execute(update(Operation).where(Operation.id == leased).values(lease_expires_at=db_now(-1)))
        with sessions.begin() as s:
            assert expire_leases(s) == [leased]
        with sessions.begin() as s:
            [r] = claim_unknown(s, worker="new-reconciler", lease_s=30, operation_id=leased)
            assert r.fencing_token == held[leased].fencing_token + 1
            settle_if_fenced(
                s,
                r,
                AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_l"),
                to=Status.SUCCEEDED,
                reason="found",
            )
        # Waiting for a person: they found nothing happened; it is sent again with the same key.
        with sessions.begin() as s:
            resolve_by_person(s, person, outcome="not-executed", by="alice", note="provider says no")
        with sessions.begin() as s:
            [c] = claim_due(s, worker="new", lease_s=30, operation_id=person)
            finalize_if_fenced(
                s,
                c,
                AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_p"),
                to=Status.SUCCEEDED,
                reason="2xx",
            )
        with sessions() as s:
            assert {o: s.get(Operation, o).status for o in (unknown, person, leased)} == dict.fromkeys(
                (unknown, person, leased), "succeeded"
            )
        # Parked by the breaker under the previous code: a breaker reset still wakes it, and only it
        # (the retries on backoff and Retry-After keep their times).
        with sessions() as s:
            before = {o: s.get(Operation, o).next_attempt_at for o in (backoff, told)}
        with sessions.begin() as s:
            assert wake_breaker_waits(s, ["payments.refund.create"], reason="reset", actor="ops") == [parked]
        with sessions() as s:
            assert {o: s.get(Operation, o).next_attempt_at for o in (backoff, told)} == before
        with sessions.begin() as s:
            [c] = claim_due(s, worker="new", lease_s=30, operation_id=parked)
        assert c.attempt_number == 1
    finally:
        engine.dispose()


def test_0005_keeps_the_key_a_sent_request_carried_and_scopes_never_sent_ones(old_ledger_url):
    """Migration 0005 (provider_key): an operation whose request may have gone out keeps the bare key
    it carried (lookups must ask for that one); one never sent gets the tenant-scoped key."""
    engine = make_engine(old_ledger_url)
    try:
        migrate.upgrade(engine)
        sessions = make_sessionmaker(engine)
        args = {"order_id": "o-1", "amount": Decimal("1.00")}
        with sessions.begin() as s:
            sent = submit(s, tenant="acme:eu", idempotency_key="k-sent", action="a", args=args, subject="s")
            submit(s, tenant="acme:eu", idempotency_key="k-queued", action="a", args=args, subject="s")
        with sessions.begin() as s:
            claim_due(s, worker="w", lease_s=30, operation_id=sent.operation_id)  # its attempt 1 opens
        migrate.downgrade(engine, "0004")
        migrate.upgrade(engine)
        with sessions() as s:
            keys = dict(s.execute(select(Operation.idempotency_key, Operation.provider_key)).all())
        assert keys == {"k-sent": "k-sent", "k-queued": "acme%3Aeu:k-queued"}
    finally:
        engine.dispose()


# -- from 4cd0727's schema (0009), with work in flight, to head, settled by real workers -------------
ON_4CD0727 = "0009"
BIG_REFUND = {"order_id": "o-9", "amount": "900.00", "currency": "EUR"}


def _tick_until(relay: Any, done: Any, what: str, timeout_s: float = 30) -> None:
    """The relay's ticks (doorbells, sweeps, run advances) one at a time until ``done()``; none after."""

    def step() -> bool:
        if done():
            return True
        relay.run_once()
        return False

    wait_for(step, timeout_s, what=what)


def _by_key(p: Any, key: str) -> Operation:
    with p.sessions() as s:
        return s.execute(select(Operation).where(Operation.idempotency_key == key)).scalar_one()


@pytest.mark.postgres
@pytest.mark.redis
def test_a_ledger_of_4cd0727_with_work_in_flight_upgrades_and_real_workers_settle_it(
    redis_url: str, sandbox: Any, tmp_path: Path
) -> None:
    """Workers leave work in every in-flight state and stop; the schema is taken back to 4cd0727's
    (0009: tables without the prefix); `migrate` brings it to head; workers started after it settle
    everything, each effect made exactly once at the provider."""
    with scratch_pg_database(f"outbox_test_upgrade_{uuid.uuid4().hex[:10]}") as url:
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        with pipeline(
            db_url=url, sessions=sessions, redis_url=redis_url, tmp=tmp_path, sandbox_url=sandbox.url, env=CLOCK_LEASE
        ) as p:
            refund = action(
                "/v1/refunds",
                decimal_args=["amount"],
                approval={"required": "when", "when": "amount > 500", "ttl_s": 3600, "policy_version": "v1"},
            )
            actions = {
                "payments.refund.create": refund,
                "support.ticket.create": action("/v1/tickets", lookup=None),  # ambiguous: a person decides
                "shop.order.create": action("/v1/orders"),
                "shop.stock.reserve": action("/v1/reservations"),
            }
            p.write_actions(actions_doc(sandbox.url, actions=actions))
            rules = load_action_rules(p.env["OUTBOX_ACTIONS_FILE"])
            # The provider commits and the answer is lost: a lookup (unknown) or a person (person) settles it.
            sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("unknown"), count=1)
            sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern=pk("person"), count=1)
            relay = p.start_relay(thread=False)
            # Waiting for a person: the action declares no lookup, so the reconciler hands it over.
            with_reconciler = p.start_worker("old-1")
            person = p.submit("person", {"subject": "refund", "customer_id": "c-1"}, action="support.ticket.create")
            approval = p.submit("approval", dict(BIG_REFUND), rules=rules, subject="agent:bot").operation_id
            _tick_until(relay, lambda: p.op(person.operation_id).status == "reconciliation_required", "a handoff")
            with_reconciler.stop()
            # Parked unknown, with no reconciler left to look it up; then a worker dies mid-call,
            # after the provider answered "leased" and before writing it down: its lease stays.
            doomed = p.start_worker(
                "old-2", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": "dispatch.after_response=exit@leased"}
            )
            unknown = p.submit("unknown", rules=rules).operation_id
            _tick_until(relay, lambda: p.op(unknown).status == "outcome_unknown", "unknown parked")
            leased = p.submit("leased", rules=rules).operation_id
            _tick_until(relay, lambda: doomed.proc.poll() is not None, "the worker dead mid-call")
            # A run between two steps: its first step succeeded, its second is due and never sent.
            p.start_worker("old-3", queues="dispatch")
            with p.sessions.begin() as s:
                steps = [
                    {"name": "order", "action": "shop.order.create", "args": {"order_ref": "mid"}},
                    {"name": "reserve", "action": "shop.stock.reserve", "args": {"sku": "A-1", "qty": 2}},
                ]
                run_id = submit_run(
                    s, tenant="t1", run_key="mid", steps=steps, subject="agent:buyer", rules=rules
                ).run_id
            _tick_until(relay, lambda: _by_key(p, "mid:order").status == "succeeded", "the run's first step")
            advance_due(p.sessions)
            p.stop()  # the previous release's workers stop for the upgrade
            assert p.op(leased).status == "dispatching" and p.op(leased).lease_owner is not None
            assert p.op(approval).status == "awaiting_approval"
            second = _by_key(p, "mid:reserve")
            assert second.status == "not_dispatched" and p.attempts(second.id) == []
            with p.sessions() as s:
                assert s.execute(select(Handoff.status).where(Handoff.operation_id == person.operation_id)).all() == [
                    ("open",)
                ]
            migrate.downgrade(engine, ON_4CD0727)
            assert {"operations", "runs", "approvals"} <= set(inspect(engine).get_table_names())
            engine.dispose()

            engine = make_engine(url)  # today's release: `agent-outbox migrate`, then its workers start
            migrate.upgrade(engine)
            assert migrate.current_revision(engine) == migrate.head_revision()
            assert not {"operations", "runs", "approvals"} & set(inspect(engine).get_table_names())
            p.sessions = make_sessionmaker(engine)
            p.workers.clear()
            p.start_worker("new")
            p.start_relay()
            done = _cli(p, "approvals", "approve", approval, "--by", "alice", "--note", "checked after the upgrade")
            assert done.returncode == 0, done.stderr
            with p.sessions() as s:
                handoff = s.execute(select(Handoff.id).where(Handoff.operation_id == person.operation_id)).scalar_one()
            [found] = sandbox.effects(key=pk("person"))
            args = [
                "--as",
                "succeeded",
                "--reference",
                found["object_id"],
                "--by",
                "alice",
                "--note",
                "in the dashboard",
            ]
            done = _cli(p, "handoffs", "resolve", str(handoff), *args)
            assert done.returncode == 0, done.stderr
            p.advance_ledger_clock(p.lease_s + 1, operation_ids=[leased])  # the dead worker's lease runs out
            for op_id in (unknown, person.operation_id, approval, leased, second.id):
                p.wait_status(op_id, "succeeded", timeout_s=60)
            wait_for(lambda: _run_status(p, run_id) == "succeeded", 30, what="the run finished")
            with p.sessions() as s:
                ops = s.execute(select(Operation.provider_key, Operation.status)).all()
                open_handoffs = s.execute(select(Handoff.id).where(Handoff.status == "open")).all()
            assert len(ops) == 6 and {status for _, status in ops} == {"succeeded"} and open_handoffs == []
            assert all(len(sandbox.effects(key=key)) == 1 for key, _ in ops), ops
            assert sandbox.duplicates() == []
            # Found by lookups, never sent again.
            assert len(sandbox.requests(method="POST", key=pk("leased"))) == 1
            assert len(sandbox.requests(method="POST", key=pk("unknown"))) == 1
        engine.dispose()


def _run_status(p: Any, run_id: str) -> str:
    with p.sessions() as s:
        return find_run(s, run_id).status
