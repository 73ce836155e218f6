"""The hot path's shortcuts keep the ledger's guarantees: one-statement claims that fill a doorbell's
batch, pipelined finalizes that refuse only the stale operation, the worker's own autocommit
connection, and the relay ringing doorbells straight from NOTIFY (once, by one relay)."""

from __future__ import annotations

import base64
import json
import threading
import time
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import select, text, update

from outbox.errors import StaleFence
from outbox.ledger.claims import claim_due
from outbox.ledger.clock import db_now
from outbox.ledger.history import HistoryEvent
from outbox.ledger.hot_path import LedgerConnection
from outbox.ledger.models import Attempt, Operation
from outbox.ledger.states import AttemptClass, Status, WaitingFor
from outbox.ledger.transitions import AttemptReport, Finalize, finalize_if_fenced, finalize_many_if_fenced
from producer import submit

ARGS = {"order_id": "o-1", "amount": "10.00", "currency": "EUR"}
OK = AttemptReport(AttemptClass.SUCCEEDED, status_code=200, provider_reference="re_1")


def _submit_many(ledger: Any, n: int, prefix: str = "k") -> list[str]:
    with ledger.sessions.begin() as s:
        return [
            submit(
                s,
                tenant="t",
                idempotency_key=f"{prefix}-{i}",
                action="payments.refund.create",
                args=ARGS,
                subject="agent",
            ).operation_id
            for i in range(n)
        ]


def test_a_doorbell_claim_takes_its_ids_first_then_fills_with_other_due_operations(ledger):
    ids = _submit_many(ledger, 6)
    with ledger.sessions.begin() as s:
        # Make the doorbell's ids the newest due rows: the fill must still put them first.
        s.execute(update(Operation).where(Operation.id.in_(ids[4:])).values(next_attempt_at=db_now(-0.5)))
        s.execute(update(Operation).where(Operation.id.in_(ids[:4])).values(next_attempt_at=db_now(-10)))
    with ledger.sessions.begin() as s:
        claims = claim_due(s, worker="w", lease_s=30, operation_ids=[ids[5], ids[4]], limit=2, also_due=3)
    got = [c.operation_id for c in claims]
    assert sorted(got[:2]) == sorted([ids[4], ids[5]])
    assert got[2:] == ids[:3], "the fill takes the oldest due operations, after the doorbell's own ids"
    with ledger.sessions.begin() as s:
        rest = claim_due(s, worker="w2", lease_s=30, operation_ids=[ids[4]], limit=1, also_due=10)
    assert [c.operation_id for c in rest] == [ids[3]], "claimed ids are never claimed twice"


def test_a_batch_finalize_refuses_only_the_operation_whose_token_is_stale(ledger):
    ids = _submit_many(ledger, 3)
    with ledger.sessions.begin() as s:
        claims = claim_due(s, worker="w", lease_s=30, limit=3)
    stale = claims[1]
    with ledger.sessions.begin() as s:  # another worker took operation 2 after our lease ran out
        s.execute(update(Operation).where(Operation.id == stale.operation_id).values(lease_expires_at=db_now(-1)))
    from outbox.ledger.leases import expire_leases

    with ledger.sessions.begin() as s:
        assert expire_leases(s) == [stale.operation_id]
    with ledger.sessions.begin() as s:
        refusals = finalize_many_if_fenced(s, [Finalize(c, OK, Status.SUCCEEDED, "ok") for c in claims])
    assert refusals[0] is None and refusals[2] is None
    assert isinstance(refusals[1], StaleFence)
    with ledger.sessions() as s:
        rows = dict(s.execute(select(Operation.id, Operation.status)).all())
        stale_row = s.execute(select(Attempt).where(Attempt.id == stale.attempt_id)).scalar_one()
    assert rows[ids[0]] == rows[ids[2]] == "succeeded"
    assert rows[stale.operation_id] == "outcome_unknown"
    assert stale_row.attempt_class == "succeeded" and stale_row.stale, "the late result is kept as evidence"


@pytest.mark.parametrize(
    "to, report, extra",
    [
        (Status.SUCCEEDED, OK, {"result": {"id": "re_1", "amount": 10}}),
        (
            Status.NOT_DISPATCHED,
            AttemptReport(AttemptClass.NOT_SENT, status_code=429, retry_after_s=7, latency_s=0.25, error="slow down"),
            {"delay_s": 7, "refund_attempt": True, "waiting_for": WaitingFor.RETRY_AFTER},
        ),
        (
            Status.OUTCOME_UNKNOWN,
            AttemptReport(AttemptClass.AMBIGUOUS, status_code=504, error="timeout"),
            {"delay_s": 3},
        ),
    ],
)
def test_a_batch_finalize_writes_what_one_finalize_writes(ledger, to, report, extra):
    """On PostgreSQL a doorbell's finalizes that make the same move go in one multi-row statement
    (pg_moves.finalize_rows); each operation must be left as finalize_if_fenced leaves it: the
    operation row, its attempt and its history, a stale member refused alone (its attempt kept as
    evidence), and a member whose attempt row had already ended still moved with an event row."""
    from outbox.ledger.drivers import pg_moves

    ids = _submit_many(ledger, 4)
    with ledger.sessions.begin() as s:
        claims = {c.operation_id: c for c in claim_due(s, worker="w", lease_s=30, limit=4)}
    one, batched, stolen, ended = (claims[i] for i in ids)
    with ledger.sessions.begin() as s:  # someone else took the third; the fourth's attempt was closed
        s.execute(update(Operation).where(Operation.id == stolen.operation_id).values(fencing_token=99))
        s.execute(update(Attempt).where(Attempt.id == ended.attempt_id).values(ended_at=db_now()))
    with ledger.sessions.begin() as s:
        finalize_if_fenced(s, one, report, to=to, reason="why: refusé, 拒否", **extra)
    before = pg_moves.finalize_rows.cache_info()
    with ledger.sessions.begin() as s:
        refusals = finalize_many_if_fenced(
            s, [Finalize(c, report, to, "why: refusé, 拒否", **extra) for c in (batched, stolen, ended)]
        )
    assert refusals[0] is None and isinstance(refusals[1], StaleFence) and refusals[2] is None
    if ledger.engine.dialect.name == "postgresql":
        after = pg_moves.finalize_rows.cache_info()
        assert after.hits + after.misses == before.hits + before.misses + 1, "one statement for the three"

    def row(op_id: str) -> tuple[Any, ...]:
        with ledger.sessions() as s:
            op = s.get(Operation, op_id)
            [attempt] = s.execute(select(Attempt).where(Attempt.operation_id == op_id)).scalars()
            events = s.execute(
                select(HistoryEvent.from_status, HistoryEvent.to_status, HistoryEvent.event, HistoryEvent.reason)
                .where(HistoryEvent.operation_id == op_id)
                .order_by(HistoryEvent.id)
            ).all()
            assert op is not None
            wait = None if op.next_attempt_at is None else round((op.next_attempt_at - op.updated_at).total_seconds())
            return (
                (op.status, op.reason, op.waiting_for, op.lease_owner, op.lease_expires_at, op.attempt_count),
                (op.result_reference, op.result_digest, op.result, op.error_class, op.last_error),
                (op.finished_at is not None, wait if to is not Status.SUCCEEDED else None),
                [tuple(e) for e in events],
                (attempt.attempt_class, attempt.status_code, attempt.retry_after_s, attempt.latency_s, attempt.error),
                attempt.stale,
            )

    assert row(batched.operation_id) == row(one.operation_id)
    assert row(one.operation_id)[0][0] == to.value
    assert row(ended.operation_id)[:4] == row(one.operation_id)[:4], "moved, and its history says so"
    kept = row(stolen.operation_id)
    assert kept[0][0] == "dispatching" and kept[5] is True and kept[4] == row(one.operation_id)[4]


def test_a_batch_whose_values_json_cannot_spell_is_finalized_row_by_row(ledger):
    """A float that is not finite (a provider's absurd Retry-After) has no JSON spelling: its group
    goes one statement per operation instead of failing the doorbell's finalize."""
    ids = _submit_many(ledger, 2, prefix="inf")
    with ledger.sessions.begin() as s:
        claims = claim_due(s, worker="w", lease_s=30, limit=2)
    report = AttemptReport(AttemptClass.NOT_SENT, status_code=429, retry_after_s=float("inf"), error="later")
    with ledger.sessions.begin() as s:
        refusals = finalize_many_if_fenced(
            s, [Finalize(c, report, Status.NOT_DISPATCHED, "later", 5.0) for c in claims]
        )
    assert refusals == [None, None]
    with ledger.sessions() as s:
        assert {s.get(Operation, i).status for i in ids} == {"not_dispatched"}
        assert {a.retry_after_s for a in s.execute(select(Attempt)).scalars()} == {float("inf")}


def test_the_worker_connection_commits_each_statement_and_reconnects_after_losing_its_backend(pg_ledger):
    ids = _submit_many(pg_ledger, 2)
    link = LedgerConnection(pg_ledger.engine)
    try:
        with link.one_statement() as conn:
            [claim] = claim_due(conn, worker="w", lease_s=30, operation_id=ids[0])
        with pg_ledger.sessions() as s:  # committed by itself: another connection sees it
            assert s.execute(select(Operation.status).where(Operation.id == ids[0])).scalar_one() == "dispatching"
        with link.one_statement() as conn:
            pid = conn.info.backend_pid
        with pg_ledger.engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(psycopg.OperationalError):
            with link.one_statement() as conn:
                conn.execute("SELECT 1")
        with link.transaction() as conn:  # a new connection
            assert conn.info.backend_pid != pid
            finalize_if_fenced(conn, claim, OK, to=Status.SUCCEEDED, reason="ok")
        with pg_ledger.sessions() as s:
            assert s.execute(select(Operation.status).where(Operation.id == ids[0])).scalar_one() == "succeeded"
    finally:
        link.close()


def test_a_finalize_rewrites_its_attempt_row_in_place(pg_ledger):
    """A finalize changes no column an index of the attempts reads (migration 0023), and the claims
    leave room on the page: PostgreSQL rewrites the row in place (HOT), with no new index entry."""
    _submit_many(pg_ledger, 10, prefix="hot")
    link = LedgerConnection(pg_ledger.engine)
    try:
        with link.one_statement() as conn:
            claims = claim_due(conn, worker="w", lease_s=30, limit=10)
        assert len(claims) == 10
        with link.transaction() as conn:
            assert (
                finalize_many_if_fenced(conn, [Finalize(c, OK, Status.SUCCEEDED, "ok") for c in claims]) == [None] * 10
            )
            # This transaction's own counts, before the statistics are flushed anywhere.
            updated, hot = conn.execute(
                "SELECT pg_stat_get_xact_tuples_updated(CAST('outbox_attempts' AS regclass)),"
                " pg_stat_get_xact_tuples_hot_updated(CAST('outbox_attempts' AS regclass))"
            ).fetchone()
        assert (updated, hot) == (10, 10), "every attempt row finalized in place"
    finally:
        link.close()


def _queued_ids(client: redis.Redis, queue: str) -> list[str]:
    ids: list[str] = []
    for raw in client.lrange(queue, 0, -1):
        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0]
        ids += args[0] if isinstance(args[0], list) else [args[0]]
    return ids


def test_notified_ids_are_rung_once_by_the_leading_relay_and_its_tick_neither_rings_nor_marks_them(pipe):
    from workers.engine.doorbell import Doorbell
    from workers.relay.loop import Relay
    from workers.wiring.celery_app import make_app

    client = redis.Redis.from_url(pipe.env["OUTBOX_BROKER_URL"])
    queue = pipe.env["OUTBOX_BROKER_KEY_PREFIX"] + "dispatch"
    first = pipe.start_relay(poll_s=30.0)  # ticks are far apart: only NOTIFY can ring during the test
    second = Relay(pipe.sessions.kw["bind"], Doorbell(make_app(pipe.settings()), batch=10), poll_s=30.0)
    thread = threading.Thread(target=second.run_forever, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not (first.leader or second.leader) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first.leader != second.leader, "exactly one relay rings doorbells from NOTIFY"
        ids = [pipe.submit(f"k-notify-{i}").operation_id for i in range(12)]
        deadline = time.monotonic() + 10
        while len(_queued_ids(client, queue)) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a duplicate from the standby would have arrived by now
        queued = _queued_ids(client, queue)
        assert sorted(queued) == sorted(ids), "every notified id rung exactly once"
        with pipe.sessions() as s:
            assert s.execute(select(Operation.published_at).where(Operation.id.in_(ids))).scalars().all() == [None] * 12
        leader = first if first.leader else second
        tick = leader.run_once()
        assert tick.dispatch == 0, "the tick does not ring what NOTIFY already rang"
        with pipe.sessions() as s:
            marked = s.execute(select(Operation.published_at).where(Operation.id.in_(ids))).scalars().all()
        assert marked == [None] * 12, "ringing by count (the queue's depth known), the tick writes no mark"
        assert len(_queued_ids(client, queue)) == 12

        # The broker's depth unreadable: the tick marks what NOTIFY rang, so it does not ring it again.
        leader.doorbell.queued_dispatch = lambda: None  # type: ignore[method-assign]
        leader.dispatch_room()
        more = [pipe.submit(f"k-notify-more-{i}").operation_id for i in range(3)]

        def rung() -> bool:  # published, then noted for the tick: wait for both
            with leader._rung_lock:
                noted = set(more) <= leader._rung
            return noted and len(_queued_ids(client, queue)) >= 15

        deadline = time.monotonic() + 10
        while not rung() and time.monotonic() < deadline:
            time.sleep(0.02)
        leader.run_once()
        with pipe.sessions() as s:
            marked = s.execute(select(Operation.published_at).where(Operation.id.in_(more))).scalars().all()
        assert all(m is not None for m in marked), "the depth unknown, the rung ids are marked"
        queued = _queued_ids(client, queue)
        # (The first twelve, never marked, may be rung again once their grace is over: harmless.)
        assert sorted(i for i in queued if i in more) == sorted(more), "and rung once"
    finally:
        second.stop()
        thread.join(3)
    # Whatever its poll_s (30 s here): a relay left listening rang the next test's ids.
    assert not thread.is_alive(), "a stopped relay stops promptly"


def test_a_listening_relays_tick_leaves_fresh_rows_to_notify_and_rings_them_once_the_grace_is_over(pipe):
    """Under load the ticks used to race the listener and ring fresh ids a second time; rows due
    before the relay began leading (nobody rang them from NOTIFY) are not left waiting."""
    from workers.engine.doorbell import Doorbell
    from workers.relay.loop import NOTIFIED_GRACE_S, Relay
    from workers.wiring.celery_app import make_app

    client = redis.Redis.from_url(pipe.env["OUTBOX_BROKER_URL"])
    queue = pipe.env["OUTBOX_BROKER_KEY_PREFIX"] + "dispatch"
    relay = Relay(pipe.sessions.kw["bind"], Doorbell(make_app(pipe.settings()), batch=10), poll_s=30.0)
    before = pipe.submit("k-grace-before").operation_id  # due before it led: no leader rang it
    relay.listening = True  # a standby (another relay leads): every fresh row is the leader's
    assert relay.run_once().dispatch == 0
    with pipe.sessions() as s:
        # As while it leads the NOTIFY path; nobody listens here: the NOTIFYs are missed.
        relay.listening, relay.leading_since = True, s.execute(select(db_now())).scalar_one()
    ids = [pipe.submit(f"k-grace-{i}").operation_id for i in range(3)]
    assert relay.run_once().dispatch == 1, "fresh rows are the NOTIFY path's; older ones the tick's at once"
    assert _queued_ids(client, queue) == [before]
    with pipe.sessions.begin() as s:  # the notification was missed: the rows have waited past the grace
        s.execute(
            update(Operation).where(Operation.id.in_(ids)).values(next_attempt_at=db_now(-(NOTIFIED_GRACE_S + 1)))
        )
    # One doorbell queued serves the four due rows (its claim takes whatever is due): none more.
    assert relay.run_once().dispatch == 0
    client.delete(queue)  # a worker took it (and, say, died): the broker holds no doorbell now
    assert relay.run_once().dispatch == 4, "every due row, rung before or not, once the broker holds none"
    assert sorted(_queued_ids(client, queue)) == sorted([before, *ids])
    relay.listening, relay.leading_since = False, None  # polling only (SQLite, or no LISTEN connection): no grace
    late = pipe.submit("k-grace-polling").operation_id
    client.delete(queue)
    assert relay.run_once().dispatch == 5
    assert _queued_ids(client, queue).count(late) == 1
