"""Reconciliation end to end (FAULTS.md F02, F03, F05, F10): real worker processes, the relay,
PostgreSQL, Redis and the sandbox. Faults are injected for real; effects are counted by the sandbox.

The reconciler's re-checks, settle windows and leases are not waited for: the tests move the
ledger's clock to each due time (Pipeline.advance_to_due / advance_ledger_clock), so the "lookup
down" cases run in seconds with the reconciler's real back-off.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import timedelta

import psycopg
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from breaker import BreakerConfig, BreakerRegistry
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.models import Evidence, Handoff
from outbox.reads.queries import explain
from tests.conftest import PG_ADMIN_URL
from tests.harness import CLOCK_LEASE, REFUND_ARGS, action, actions_doc, max_in_any_window, pk, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def posts(sandbox, key):
    return sandbox.requests(method="POST", key=pk(key))


def lookups(sandbox, key):
    return sandbox.requests(method="GET", key=pk(key))


def test_commit_then_drop_reconciled_with_the_providers_id(pipe, sandbox):
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-drop")
    op = pipe.wait_status(r.operation_id, "succeeded")
    effects = sandbox.effects(key=pk("rc-drop"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    # Zero re-sends: the only POST is the one whose answer was dropped; then the lookup.
    sent = posts(sandbox, "rc-drop")
    assert [p["status"] for p in sent] == ["reset"]
    found = [g for g in lookups(sandbox, "rc-drop") if g["status"] == 200]
    assert found and found[0]["seq"] > sent[0]["seq"]
    dispatches = pipe.attempts(r.operation_id, "dispatch")
    assert [a.attempt_class for a in dispatches] == ["ambiguous"]
    assert pipe.attempts(r.operation_id, "lookup")[-1].provider_reference == op.result_reference


def test_lookup_down_for_a_while_then_back(pipe, sandbox):
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    pipe.env.update(CLOCK_LEASE)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-down")
    pipe.wait_attempt_done(r.operation_id, 1)
    for n in (1, 2, 3):  # three failed lookups; each re-check (backing off) is moved to, not waited for
        pipe.advance_to_due(r.operation_id)
        assert pipe.wait_attempt_done(r.operation_id, n, kind="lookup").status_code == 503
        assert pipe.op(r.operation_id).status == "outcome_unknown"
        assert len(posts(sandbox, "rc-down")) == 1, "re-sent while the outcome was unknown"
    assert len([g for g in lookups(sandbox, "rc-down") if g["status"] == 503]) >= 3
    sandbox.remove_fault(down["id"])
    pipe.advance_to_due(r.operation_id)
    op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=15)
    assert len(posts(sandbox, "rc-down")) == 1
    effects = sandbox.effects(key=pk("rc-down"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]


def test_lookups_never_asked_spend_none_of_the_reconcilers_budget(pipe, sandbox):
    """A lookup parked by an open breaker is on record (not_sent, nothing timed) but was never sent:
    with OUTBOX_RECONCILE_MAX_LOOKUPS=2 and three of them, the first lookup that fails is lookup 1
    of 2, not a spent budget handed to a person."""
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["timeout_s"] = 1
    pipe.write_actions(doc)
    # Committed, then no answer within the call's timeout: the breaker opens while the call is out,
    # so the first lookup (due soon after the timeout) already finds it open.
    sandbox.add_fault(mode="commit_then_stall", method="POST", count=1, stall_s=3)
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "2"})
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-parked")
    wait_for(lambda: posts(sandbox, "rc-parked"), 10, what="the call at the provider")
    breakers = BreakerRegistry(
        {"sandbox": BreakerConfig(fail_max=1, reset_timeout_s=300)},
        redis_url=pipe.env["OUTBOX_REDIS_URL"],
        namespace=pipe.env["OUTBOX_BROKER_KEY_PREFIX"],
    )
    try:
        breakers.record(breakers.before_call("sandbox"), failure=True)  # open, as failures would open it
        assert pipe.wait_attempt_done(r.operation_id, 1).attempt_class == "ambiguous"
        for n in (1, 2, 3):
            pipe.advance_to_due(r.operation_id)
            parked = pipe.wait_attempt_done(r.operation_id, n, kind="lookup")
            assert (parked.attempt_class, parked.status_code, parked.latency_s) == ("not_sent", None, None)
            assert pipe.op(r.operation_id).status == "outcome_unknown"
        assert lookups(sandbox, "rc-parked") == []
        breakers.reset("sandbox", by="test")
    finally:
        breakers.close()
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    pipe.advance_to_due(r.operation_id)
    failed = pipe.wait_attempt_done(r.operation_id, 4, kind="lookup")
    assert failed.status_code == 503 and failed.attempt_class == "ambiguous"
    op = pipe.op(r.operation_id)
    assert op.status == "outcome_unknown", op.reason  # lookup 1 of 2 sent: not yet a person's
    sandbox.remove_fault(down["id"])
    pipe.advance_to_due(r.operation_id)
    op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=15)
    assert len(posts(sandbox, "rc-parked")) == 1 and len(sandbox.effects(key=pk("rc-parked"))) == 1


def test_not_found_after_the_provider_forgot_the_key_goes_to_a_person(pipe, sandbox):
    """Issue 15: the provider keeps keys retention_s; a "not found" later than that after the first
    attempt may be a forgotten key whose effect exists. It is no proof: a person decides, and
    nothing is re-sent (a re-send under a forgotten key could be a second effect)."""
    retention_s = 600
    keys = {"header": "Idempotency-Key", "retention_s": retention_s}
    budget = {"max_attempts": 4, "deadline_s": 3600, "base_delay_s": 0.1, "max_delay_s": 1}
    refund = action("/v1/refunds", decimal_args=["amount"], provider_idempotency=keys, budget=budget)
    pipe.write_actions(actions_doc(sandbox.url, actions={"payments.refund.create": refund}))
    sandbox.add_fault(mode="drop_before_commit", method="POST", count=1)  # nothing made; the answer lost
    down = sandbox.add_fault(mode="unavailable_503", method="GET", path="/v1/refunds")
    pipe.env.update(CLOCK_LEASE)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-forgot")
    pipe.wait_attempt_done(r.operation_id, 1)
    pipe.advance_to_due(r.operation_id)
    assert pipe.wait_attempt_done(r.operation_id, 1, kind="lookup").status_code == 503
    # The lookup stays down longer than the provider remembers keys.
    pipe.advance_ledger_clock(retention_s + 1, operation_ids=[r.operation_id])
    sandbox.remove_fault(down["id"])
    pipe.advance_to_due(r.operation_id)
    op = pipe.wait_status(r.operation_id, "reconciliation_required", timeout_s=20)
    assert f"retention_s={retention_s}s" in (op.reason or "") and "a person must decide" in (op.reason or "")
    assert [p["status"] for p in posts(sandbox, "rc-forgot")] == ["reset"]  # never re-sent
    assert sandbox.effects(key=pk("rc-forgot")) == []


def test_lookup_never_back_hands_off_with_a_complete_packet(pipe, sandbox):
    doc = actions_doc(
        sandbox.url,
        actions={
            "payments.refund.create": action("/v1/refunds", decimal_args=["amount"], sensitive_args=["reason"]),
        },
    )
    pipe.write_actions(doc)
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)
    sandbox.add_fault(mode="fail_before_commit", method="GET", path="/v1/refunds", status=500)
    pipe.env.update(CLOCK_LEASE | {"OUTBOX_RECONCILE_MAX_LOOKUPS": "3"})
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-never")
    pipe.wait_attempt_done(r.operation_id, 1)
    for n in (1, 2):  # the re-checks after the first two failed lookups: moved to, not waited for
        pipe.advance_to_due(r.operation_id)
        pipe.wait_attempt_done(r.operation_id, n, kind="lookup")
    pipe.advance_to_due(r.operation_id)
    op = pipe.wait_status(r.operation_id, "reconciliation_required", timeout_s=20)
    assert len(posts(sandbox, "rc-never")) == 1
    assert len(sandbox.effects(key=pk("rc-never"))) == 1  # the effect exists: only a person may say so
    with pipe.sessions() as s:
        handoff = s.execute(select(Handoff).where(Handoff.operation_id == op.id)).scalar_one()
        packet = handoff.packet
    # 1. ids, key, tenant, action, target
    assert packet["operation"] == {
        "operation_id": op.id,
        "idempotency_key": "rc-never",
        "provider_key": "t1:rc-never",
        "tenant": "t1",
        "action": "payments.refund.create",
        "target": "sandbox",
    }
    # 2. every attempt: the dispatch and the three lookups, with token, digest and class
    kinds = [(a["kind"], a["class"]) for a in packet["attempts"]]
    assert kinds[0] == ("dispatch", "ambiguous") and len([k for k in kinds if k[0] == "lookup"]) == 3
    assert packet["attempts"][0]["request_digest"] and all(a["fencing_token"] for a in packet["attempts"])
    assert all(a["error"] for a in packet["attempts"])
    # 3. the raw last error and its class
    assert packet["last_error"]["class"] == "ambiguous" and packet["last_error"]["raw"]
    assert "budget spent (3 lookups)" in packet["last_error"]["why_handed_off"]
    # 4. the next step
    assert "rc-never" in packet["next_step"] and "handoffs resolve" in packet["next_step"]
    # 5. the intent, sensitive fields masked
    assert packet["intent"]["args"] == dict(REFUND_ARGS, reason="***")
    assert packet["intent"]["args_digest"] == op.args_digest and packet["intent"]["subject"] == "test"


def test_early_not_found_waits_for_settle_then_redispatches_with_the_same_key(pipe, sandbox):
    # The request reaches the provider, is not committed, and the client sees a 500 (ambiguous).
    # The provider's index lags, so a 404 inside settle_s proves nothing; after it, it does. The
    # window is a minute long and passes only when the test moves the ledger's clock.
    settle_s = 60.0
    sandbox.configure(index_lag_s=1.0)
    lookup = action("/v1/refunds")["lookup"] | {"settle_s": settle_s}
    pipe.write_actions(
        actions_doc(
            sandbox.url,
            actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"], lookup=lookup)},
        )
    )
    sandbox.add_fault(mode="fail_before_commit", method="POST", status=500, count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-lag")
    # An early 404 (inside the settle window) re-checks at the window's end; nothing is re-sent.
    early = wait_for(
        lambda: [a for a in pipe.attempts(r.operation_id, "lookup") if "inside the settle window" in (a.error or "")],
        15,
        what="a lookup inside the settle window",
    )
    [first] = pipe.attempts(r.operation_id, "dispatch")
    op = pipe.wait_status(r.operation_id, "outcome_unknown")
    assert op.next_attempt_at >= first.ended_at + timedelta(seconds=settle_s) - timedelta(milliseconds=5)
    assert [p["status"] for p in posts(sandbox, "rc-lag")] == [500]
    assert early[0].status_code == 404

    pipe.advance_ledger_clock(settle_s)
    op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=20)
    sent = posts(sandbox, "rc-lag")
    assert [p["status"] for p in sent] == [500, 200]
    assert sent[1]["fencing_token"] > sent[0]["fencing_token"]
    assert sent[0]["idempotency_key"] == sent[1]["idempotency_key"] == pk("rc-lag")
    gets = [g for g in lookups(sandbox, "rc-lag") if sent[0]["seq"] < g["seq"] < sent[1]["seq"]]
    assert all(g["status"] == 404 for g in gets) and len(gets) >= 2
    # On the ledger's clock the re-send came after the settle window, from the failed attempt's end.
    [first, second] = pipe.attempts(r.operation_id, "dispatch")
    assert second.started_at - first.ended_at >= timedelta(seconds=settle_s)
    reasons = [a.error or "" for a in pipe.attempts(r.operation_id, "lookup")]
    assert any("authoritative not found" in x for x in reasons)
    effects = sandbox.effects(key=pk("rc-lag"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]


def test_provider_without_idempotency_is_never_resent_without_proof(pipe, sandbox):
    # The careless provider ignores Idempotency-Key for deduplication (a replay would create a
    # second refund) but keeps it on the object, so the lookup can still find it by key.
    sandbox.configure(idempotency=False)
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=1)
    pipe.start_worker()
    pipe.start_relay()
    r = pipe.submit("rc-careless")
    op = pipe.wait_status(r.operation_id, "succeeded")
    assert len(posts(sandbox, "rc-careless")) == 1
    effects = sandbox.effects(key=pk("rc-careless"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    assert sandbox.duplicates() == []


def test_worker_killed_after_the_provider_committed(pipe, sandbox):
    # F03: the answer arrived, the worker died before storing it. Lease expiry -> outcome_unknown
    # -> a second worker's lookup settles it; nothing is sent twice.
    pipe.env.update(CLOCK_LEASE)
    crashing = pipe.start_worker(
        "crash", queues="dispatch", extra_env={"OUTBOX_FAILPOINTS": "dispatch.after_response=exit"}
    )
    pipe.start_worker("reconciler", queues="outcome_unknown")
    pipe.start_relay()
    r = pipe.submit("rc-crash")
    wait_for(lambda: crashing.proc.poll() is not None, 15, what="the worker to die at the failpoint")
    assert crashing.proc.returncode == 137
    assert pipe.op(r.operation_id).status == "dispatching"  # until its lease runs out
    pipe.advance_ledger_clock(pipe.lease_s)
    op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=20)
    assert pipe.attempts(r.operation_id, "lookup")[-1].attempt_class == "succeeded"  # settled by a lookup
    assert [p["status"] for p in posts(sandbox, "rc-crash")] == [200]
    effects = sandbox.effects(key=pk("rc-crash"))
    assert len(effects) == 1 and op.result_reference == effects[0]["object_id"]
    with pipe.sessions() as s:
        events = [(e["from"], e["to"]) for e in explain(s, op.id).as_json()["history"]]
    assert ("dispatching", "outcome_unknown") in events


@pytest.fixture
def evidence_db():
    """A separate PostgreSQL database for the evidence sink, which the test can take down."""
    name = f"outbox_evidence_{uuid.uuid4().hex[:8]}"
    admin_url = make_url(PG_ADMIN_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    admin = psycopg.connect(admin_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)

    class Db:
        def down(self) -> None:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

        def up(self) -> None:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    db = Db()
    db.url, db.name = url, name  # type: ignore[attr-defined]
    try:
        yield db
    finally:
        db.up()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


class WatchedSink(EvidenceSink):
    """The relay's evidence sink, counting the backfill writes that failed, per operation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: Counter[str] = Counter()

    def write(self, record, *, session=None):
        try:
            super().write(record, session=session)
        except Exception:
            self.failed[record.operation_id] += 1
            raise


def test_evidence_sink_down_after_success_is_degraded_then_backfilled(pipe, sandbox, evidence_db, monkeypatch):
    import workers.relay.loop

    monkeypatch.setattr(workers.relay.loop, "BACKFILL_EVERY_S", 0.2)  # the relay runs in this process
    pipe.env["OUTBOX_EVIDENCE_URL"] = evidence_db.url
    sink = WatchedSink.from_url(evidence_db.url)
    try:
        pipe.start_worker()
        pipe.start_relay(evidence_sink=sink)
        warm = pipe.submit("ev-warm")  # the sink works: evidence written with the success
        pipe.wait_status(warm.operation_id, "succeeded")
        evidence_db.down()
        r = pipe.submit("ev-down")
        op = pipe.wait_status(r.operation_id, "committed_evidence_degraded", "succeeded")
        assert op.status == "committed_evidence_degraded"
        assert op.result_reference == sandbox.effects(key=pk("ev-down"))[0]["object_id"]
        # Never retried: the effect happened. Still degraded across a few backfill attempts.
        wait_for(lambda: sink.failed[r.operation_id] >= 3, 15, what="three backfills failing against the dead sink")
        assert pipe.op(r.operation_id).status == "committed_evidence_degraded"
        assert len(posts(sandbox, "ev-down")) == 1
        evidence_db.up()
        op = pipe.wait_status(r.operation_id, "succeeded", timeout_s=15)
        assert len(posts(sandbox, "ev-down")) == 1 and len(sandbox.effects(key=pk("ev-down"))) == 1
        with sink.engine.connect() as conn:  # type: ignore[union-attr]
            rows = conn.execute(select(Evidence.operation_id, Evidence.provider_reference)).all()
        assert sorted(rows) == sorted(
            [(warm.operation_id, pipe.op(warm.operation_id).result_reference), (op.id, op.result_reference)]
        )
        with pipe.sessions() as s:
            events = [e["event"] for e in explain(s, op.id).as_json()["history"]]
        assert "evidence backfilled" in events
    finally:
        sink.close()


def test_a_reconcile_doorbell_fills_its_batch_and_settles_it_in_one_transaction(pipe, sandbox):
    """Issue 14: a reconcile doorbell carried 1-2 ids while a backlog of lookups waited; it now
    claims others that are due up to its batch and settles them in one transaction. One of them
    losing its lease between lookup and settle must not take the others down: its lookup stays as
    evidence (stale) and its success is applied from that evidence; every effect is counted once."""
    from sqlalchemy import update

    from outbox.ledger import failpoints
    from outbox.ledger.models import Attempt, Operation
    from workers.wiring.runtime import build_runtime

    n = 12
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=n)
    pipe.start_worker(queues="dispatch")  # no reconciler: the lookups wait for the test
    pipe.start_relay()
    ids = [pipe.submit(f"rc-fill-{i}").operation_id for i in range(n)]
    for op_id in ids:
        pipe.wait_status(op_id, "outcome_unknown")
    pipe._relay.stop()
    pipe._relay_thread.join(10)

    stolen: list[str] = []
    steal_once = threading.Lock()  # lookups run on threads of their own, each hitting the failpoint

    def steal_another(_key: str | None) -> None:
        # Between the first lookup and the settle, someone else (the sweep, another reconciler)
        # takes a second operation of the batch: its token moves on. Once, and never one whose
        # settle is under way: the committer settles whatever lookups have arrived, so by the time
        # a lookup thread gets here another may be committing (CI: the steal waited on its row lock
        # and bumped a token already settled, leaving a lookup that was not stale).
        with steal_once, pipe.sessions.begin() as s:
            if stolen:
                return
            victim = s.execute(
                select(Operation.id)
                .where(Operation.id.in_(ids), Operation.lease_owner.is_not(None), Operation.status == "outcome_unknown")
                .with_for_update(skip_locked=True)
            ).scalars()
            other = next(v for v in victim if v != ids[0])
            s.execute(update(Operation).where(Operation.id == other).values(fencing_token=Operation.fencing_token + 1))
            stolen.append(other)

    rt = build_runtime(pipe.settings())
    try:
        with failpoints.on("reconcile.after_lookup", steal_another):
            settled = rt.reconciler.reconcile([ids[0]], fill_to=10)
    finally:
        rt.close()
    assert len(settled) == 10 and ids[0] in settled  # its own id plus nine others that were due
    statuses = Counter(pipe.op(i).status for i in ids)
    assert statuses == {"succeeded": 10, "outcome_unknown": 2}, statuses
    with pipe.sessions() as s:
        stale = s.execute(
            select(Attempt).where(Attempt.operation_id == stolen[0], Attempt.kind == "lookup")
        ).scalar_one()
    assert stale.stale and stale.attempt_class == "succeeded"  # the lookup's answer kept as evidence
    assert pipe.op(stolen[0]).status == "succeeded"  # and applied from it
    for i in range(n):
        assert len(sandbox.effects(key=pk(f"rc-fill-{i}"))) == 1
        assert len(posts(sandbox, f"rc-fill-{i}")) == 1
    with pipe.sessions() as s:
        assert s.query(Evidence).filter(Evidence.operation_id.in_(ids)).count() == 10


def _parked_in_outcome_unknown(pipe, sandbox, n: int, prefix: str) -> list[str]:
    """n operations whose first request committed and lost its answer, waiting for lookups that
    nobody makes: the relay is stopped and no reconciler runs."""
    sandbox.add_fault(mode="commit_then_drop", method="POST", count=n)
    pipe.start_worker(queues="dispatch")
    pipe.start_relay()
    ids = [pipe.submit(f"{prefix}-{i}").operation_id for i in range(n)]
    for op_id in ids:
        pipe.wait_status(op_id, "outcome_unknown")
    pipe._relay.stop()
    pipe._relay_thread.join(10)
    return ids


def test_a_reconcile_doorbell_whose_ids_were_taken_still_claims_what_is_due(pipe, sandbox):
    """A doorbell only says "lookups may be waiting": when another doorbell's claim took its ids
    along (or they were settled), it must still claim what is due, never find nothing to do while
    lookups wait (a reconciler that fell behind ran thousands of such empty tasks)."""
    from workers.wiring.runtime import build_runtime

    ids = _parked_in_outcome_unknown(pipe, sandbox, 12, "rc-taken")
    rt = build_runtime(pipe.settings())
    try:
        first = rt.reconciler.reconcile(ids[:10], fill_to=10)
        assert sorted(first) == sorted(ids[:10])
        # The same ten ids rung again (a duplicate doorbell): they are settled, two others wait.
        again = rt.reconciler.reconcile(ids[:10], fill_to=10)
    finally:
        rt.close()
    assert sorted(again) == sorted(ids[10:]), again
    assert Counter(pipe.op(i).status for i in ids) == {"succeeded": 12}
    for i in range(12):
        assert len(sandbox.effects(key=pk(f"rc-taken-{i}"))) == 1


# The sandbox is a thread of this test process: on a loaded machine a stall of its loop holds an
# answer past the default 1 s read timeout, and that lookup is "unavailable", its operation left in
# outcome_unknown (a CI failure; a 0.9 s stall of the loop as the lookups go out gives the same). A
# test of overlap, not of timeouts: 5 s to answer, and the time limits a process then requires (its
# soft limit above timeout + connect timeout; soft < hard < lease).
ROOM_TO_ANSWER = {"OUTBOX_SOFT_TIME_LIMIT_S": "10", "OUTBOX_TIME_LIMIT_S": "12", "OUTBOX_LEASE_S": "30"}


def test_a_doorbells_lookups_overlap_at_a_slow_provider(pipe, sandbox):
    """A provider's search takes tens or hundreds of milliseconds; one reconciler process must not
    look its operations up one after another (one process then drains ~19/s at 50 ms)."""
    from workers.wiring.runtime import build_runtime

    pipe.env.update(ROOM_TO_ANSWER)
    pipe.write_actions(actions_doc(sandbox.url, timeout_s=5))
    ids = _parked_in_outcome_unknown(pipe, sandbox, 10, "rc-slow")
    sandbox.add_fault(mode="latency", latency_ms=300, method="GET", path="/v1/refunds")
    rt = build_runtime(pipe.settings())
    try:
        settled = rt.reconciler.reconcile(ids, fill_to=10)
    finally:
        rt.close()
    assert sorted(settled) == sorted(ids) and {v.to.value for v in settled.values()} == {"succeeded"}
    # Overlap as the provider saw it, not as a wall-clock total that a stalled test process stretches:
    # each lookup is held 300 ms there, so lookups that arrive within 300 ms of each other were out at
    # the same time; one after another, no two would be. Overlapped: the first lookup, then the nine
    # beside each other (the watchdog gives each a thread of its own once the first has run 50 ms).
    arrivals = [e["time"] for e in sandbox.requests(method="GET", path="/v1/refunds")]
    offsets = [round(t - min(arrivals), 3) for t in sorted(arrivals)] if arrivals else []
    assert len(arrivals) == 10 and max_in_any_window(arrivals, 0.3) >= 9, f"lookups arrived at {offsets} s"
    assert all(len(sandbox.effects(key=pk(f"rc-slow-{i}"))) == 1 for i in range(10))


def test_the_relay_rings_due_lookups_once_while_their_doorbells_queue(pipe, sandbox):
    """The relay rings as many reconcile doorbells as the due lookups need, less those queued: a
    reconciler that falls behind must not get each lookup rung again every republish_after_s
    while its first doorbell still waits (each duplicate then claims nothing)."""
    import time

    import redis

    from workers.engine.doorbell import Doorbell
    from workers.relay.loop import Relay
    from workers.wiring.celery_app import make_app

    ids = _parked_in_outcome_unknown(pipe, sandbox, 25, "rc-ring")
    client = redis.Redis.from_url(pipe.env["OUTBOX_BROKER_URL"])
    queue = pipe.env["OUTBOX_BROKER_KEY_PREFIX"] + "outcome_unknown"
    client.delete(queue)  # what the stopped relay rang: start from an empty queue
    relay = Relay(
        pipe.sessions.kw["bind"],
        Doorbell(make_app(pipe.settings()), batch=10),
        poll_s=30.0,
        republish_after_s=0.1,
        sweep_every_s=3600,
    )
    first = relay.run_once()
    assert first.reconcile == len(ids) and client.llen(queue) == 3  # 25 due lookups: 3 doorbells
    time.sleep(0.3)  # past republish_after_s: nothing was lost, the doorbells still queue
    relay.run_once()
    relay.run_once()
    assert client.llen(queue) == 3
    client.lpop(queue)  # a reconciler took one doorbell (and claimed nothing yet)
    relay.run_once()
    assert client.llen(queue) == 3, "the doorbell taken is replaced, no more"
