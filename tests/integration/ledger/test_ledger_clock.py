"""outbox.testing.advance_ledger_clock: the ledger's clock as a test input, on SQLite and PostgreSQL.

Moving the clock must be indistinguishable, for every time decision the ledger takes, from that
much time passing: leases run out, due times arrive, deadlines pass; nothing else changes.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import threading
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import DateTime, insert, select, text, update
from sqlalchemy.orm import Session

from outbox.evidence.handoffs import open_handoff
from outbox.ledger.claims import claim_due
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.history import HistoryEvent
from outbox.ledger.key_uses import KeyUse
from outbox.ledger.leases import expire_leases
from outbox.ledger.models import (
    ApiKey,
    Approval,
    Attempt,
    Base,
    Evidence,
    Handoff,
    Operation,
    OperationEvent,
    ReportRun,
    Run,
    core_table,
)
from outbox.ledger.scope_models import BudgetCharge, ObjectHold, ScopeSpend
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.stop_models import SubjectStop
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from outbox.ledger.webhook_models import WebhookEvent
from outbox.testing import advance_ledger_clock, ledger_timestamp_columns
from producer import submit
from tests.harness import wait_for

INTENT = dict(
    tenant="acme",
    action="payments.refund.create",
    args={"order_id": "o-17", "amount": Decimal("25.00"), "currency": "EUR"},
    subject="agent:test",
)


def _submit(ledger, key, **over) -> str:
    with ledger.sessions.begin() as s:
        return submit(s, idempotency_key=key, **(INTENT | over)).operation_id


def _claim(ledger, *, lease_s=30.0, **kw):
    with ledger.sessions.begin() as s:
        return claim_due(s, worker="w", lease_s=lease_s, **kw)


def _expired(ledger) -> list[str]:
    with ledger.sessions.begin() as s:
        return expire_leases(s)


def _snapshot(ledger) -> dict[tuple[str, tuple], dict[str, object]]:
    """Every row of every ledger table that has timestamps, by (table, primary key)."""
    rows = {}
    with ledger.engine.connect() as conn:
        for table in ledger_timestamp_columns():
            # A timestamp in a primary key (key uses by minute) moves too: rows are named without it.
            keys = [k for k in table.primary_key.columns if not isinstance(k.type, DateTime)]
            for row in conn.execute(select(table)).mappings():
                rows[(table.name, tuple(row[k.name] for k in keys))] = dict(row)
    return rows


def test_every_stored_timestamp_moves_back_exactly_and_nothing_else_changes(ledger):
    done = _submit(ledger, "k-done", deadline_s=600)
    [claim] = _claim(ledger, operation_id=done)
    with ledger.sessions.begin() as s:
        finalize_if_fenced(
            s,
            claim,
            AttemptReport(AttemptClass.SUCCEEDED, provider_reference="re_1"),
            to=Status.SUCCEEDED,
            reason="2xx",
        )
        s.execute(update(Attempt).where(Attempt.operation_id == done).values(applied_at=db_now()))
        s.execute(
            insert(Evidence).values(
                operation_id=done,
                tenant="acme",
                idempotency_key="k-done",
                action=INTENT["action"],
                args_digest="d" * 64,
                attempt_log_digest="a" * 64,
                recorded_at=db_now(),
            )
        )
        s.execute(update(Operation).where(Operation.id == done).values(published_at=db_now(-1)))
        s.execute(
            insert(ApiKey).values(
                key_hash="h" * 64, prefix="ao_x", tenant="acme", scopes="read", created_at=db_now(), revoked_at=db_now()
            )
        )
        s.execute(
            insert(Approval).values(
                operation_id=done,
                tenant="acme",
                action=INTENT["action"],
                args_digest="d" * 64,
                requested_by="agent",
                policy_version="v1",
                decision="approved",
                approver="alice",
                decided_at=db_now(),
                expires_at=db_now(60),
            )
        )
        s.execute(
            insert(Run).values(
                id="00000000-0000-0000-0000-000000000001",
                tenant="acme",
                run_key="r-1",
                subject="agent",
                status="succeeded",
                steps="[]",
                spec_digest="d" * 64,
                deadline_at=db_now(60),
                cancel_requested=False,
                compensate_requested=False,
                history=[],
                created_at=db_now(),
                updated_at=db_now(),
                finished_at=db_now(),
                purged_at=db_now(),
            )
        )
        s.execute(
            insert(ReportRun).values(
                started_at=db_now(),
                finished_at=db_now(),
                since=db_now(-86400),
                complete=True,
                discrepancies=0,
                duplicate_effects=0,
                by_tenant={},
                health={},
                findings={},
                ran_by="test",
            )
        )
        s.execute(
            insert(ObjectHold).values(tenant="acme", object_key="order:o-17", operation_id=done, taken_at=db_now())
        )
        s.execute(
            insert(ScopeSpend).values(
                tenant="acme",
                scope="conv-1",
                bucket="*",
                calls=1,
                amount_micros=0,
                opened_at=db_now(-60),
                updated_at=db_now(),
            )
        )
        s.execute(
            insert(BudgetCharge).values(
                attempt_id=1, operation_id=done, tenant="acme", scope="conv-1", charged_at=db_now()
            )
        )
        s.execute(
            insert(KeyUse).values(tenant="acme", action=INTENT["action"], minute=db_now(), replays=1, conflicts=0)
        )
        s.execute(
            insert(SubjectStop).values(tenant="acme", subject="agent:x", stopped_by="cli:test", stopped_at=db_now())
        )
        s.execute(
            insert(WebhookEvent).values(
                target="payments",
                scope="",
                verified_by="target",
                event_id="evt_1",
                event_type="refund.succeeded",
                scheme="standard",
                received_at=db_now(),
                signed_at=db_now(-5),
                body_digest="b" * 64,
                disposition="recorded",
            )
        )
        # On PostgreSQL the hot path writes no event rows (submits, claims and results are recorded
        # on the operation and attempt rows: ledger/history.py); other events are rows (this one names
        # no move: the suite's check of moves taken reads only rows with a from_status).
        s.execute(
            insert(OperationEvent).values(
                operation_id=done,
                at=db_now(),
                from_status=None,
                to_status="succeeded",
                fencing_token=1,
                event="note",
                reason="test",
                actor="test",
            )
        )
        handoff = open_handoff(s, done, reason="test", packet={"x": 1})
        s.execute(
            update(Handoff)
            .where(Handoff.id == handoff)
            .values(
                status="resolved",
                resolved_at=db_now(),
                taken_at=db_now(),
                next_check_at=db_now(60),
                checks_until=db_now(86400),
            )
        )
    leased = _submit(ledger, "k-leased", delay_s=0.0)
    _claim(ledger, operation_id=leased)

    before = _snapshot(ledger)
    moved = advance_ledger_clock(ledger.engine, 3600.25)
    after = _snapshot(ledger)

    assert moved == len(before)  # every row here has at least one timestamp
    assert after.keys() == before.keys()
    # From the models, not from the helper: a column it left out must show up here.
    columns = {t.name: {c.name for c in t.columns if isinstance(c.type, DateTime)} for t in Base.metadata.sorted_tables}
    seen = set()
    for (table, pk), row in before.items():
        for name, value in row.items():
            new = after[(table, pk)][name]
            if name in columns[table] and value is not None:
                assert as_utc(new) == as_utc(value) - dt.timedelta(seconds=3600.25), (table, pk, name)
                seen.add((table, name))
            else:
                assert new == value, (table, pk, name)
    # Every kind of timestamp the ledger keeps was present and moved (a new column must be added here).
    assert seen == {(t, c) for t, cs in columns.items() for c in cs}, sorted(
        {(t, c) for t, cs in columns.items() for c in cs} - seen
    )


def test_the_column_list_is_every_datetime_column_of_the_models_operations_last():
    found = {t.name: [c.name for c in cols] for t, cols in ledger_timestamp_columns().items()}
    # Operations move last: no decision sees an operation ahead of its attempts.
    assert list(found)[-1] == core_table(Operation).name
    for model in (Operation, Attempt, OperationEvent, Handoff, Evidence):
        table = core_table(model)
        assert found[table.name] == [c.name for c in table.columns if isinstance(c.type, DateTime)]
    for model, names in {
        Operation: ["lease_expires_at", "deadline_at", "next_attempt_at", "published_at", "created_at"],
        Attempt: ["started_at", "ended_at", "applied_at"],
        OperationEvent: ["at"],
        Handoff: ["opened_at", "resolved_at"],
        Evidence: ["recorded_at"],
    }.items():
        table = core_table(model).name
        assert set(names) <= set(found[table]), (table, found[table])


def test_a_lease_runs_out_only_once_the_clock_passes_it(ledger):
    op_id = _submit(ledger, "k-lease")
    _claim(ledger, lease_s=30)
    assert _expired(ledger) == []
    # Five seconds early, not one: real time passes between these lines too (over a second, seen on
    # a loaded machine).
    advance_ledger_clock(ledger.engine, 25)
    assert _expired(ledger) == [], "expired early"
    advance_ledger_clock(ledger.engine, 5.5)
    assert _expired(ledger) == [op_id]
    with ledger.sessions() as s:
        assert s.get(Operation, op_id).status == Status.OUTCOME_UNKNOWN.value


def test_a_due_time_arrives_only_once_the_clock_reaches_it(ledger):
    op_id = _submit(ledger, "k-due", delay_s=120)
    assert _claim(ledger) == []
    advance_ledger_clock(ledger.engine, 115)  # five seconds before it (real time passes too)
    assert _claim(ledger) == []
    advance_ledger_clock(ledger.engine, 5.5)
    [claim] = _claim(ledger)
    assert claim.operation_id == op_id


def test_a_deadline_passes_and_stays_the_same_distance_from_creation(ledger):
    op_id = _submit(ledger, "k-deadline", deadline_s=60)

    def past_deadline() -> bool:
        with ledger.sessions() as s:
            return bool(s.execute(select(Operation.deadline_at <= db_now()).where(Operation.id == op_id)).scalar_one())

    def window() -> dt.timedelta:
        with ledger.sessions() as s:
            op = s.get(Operation, op_id)
            return as_utc(op.deadline_at) - as_utc(op.created_at)

    assert not past_deadline()
    before = window()
    assert abs(before - dt.timedelta(seconds=60)) < dt.timedelta(seconds=1)
    advance_ledger_clock(ledger.engine, 61)
    assert past_deadline()
    assert window() == before


def test_operation_ids_move_the_clock_for_those_operations_only(ledger):
    a = _submit(ledger, "k-a", delay_s=120)
    b = _submit(ledger, "k-b", delay_s=120)
    with ledger.sessions() as s:
        b_events = [as_utc(e) for e in s.scalars(select(HistoryEvent.at).where(HistoryEvent.operation_id == b))]
    advance_ledger_clock(ledger.engine, 121, operation_ids=[a])
    assert [c.operation_id for c in _claim(ledger, limit=10)] == [a]
    with ledger.sessions() as s:
        assert [as_utc(e) for e in s.scalars(select(HistoryEvent.at).where(HistoryEvent.operation_id == b))] == (
            b_events
        )
    assert advance_ledger_clock(ledger.engine, 5, operation_ids=[]) == 0


def test_inside_a_session_the_move_is_part_of_its_transaction(ledger):
    op_id = _submit(ledger, "k-session", delay_s=120)
    with pytest.raises(RuntimeError):
        with ledger.sessions.begin() as s:
            # The operation (and on SQLite its "submit" event row; PostgreSQL records it on the operation).
            assert advance_ledger_clock(s, 121) == (1 if ledger.engine.dialect.name == "postgresql" else 2)
            raise RuntimeError("rolled back")
    assert _claim(ledger) == []
    with ledger.sessions.begin() as s:
        advance_ledger_clock(s, 121)
    assert [c.operation_id for c in _claim(ledger)] == [op_id]


def test_a_row_written_meanwhile_is_moved_with_its_new_value_not_overwritten(pg_ledger):
    """A worker's transaction holds the row: the move waits for it and then moves what it wrote."""
    op_id = _submit(pg_ledger, "k-busy")
    writer = pg_ledger.new_engine()
    try:
        with Session(writer) as w, w.begin():
            w.execute(update(Operation).where(Operation.id == op_id).values(next_attempt_at=db_now(6000)))
            mover = threading.Thread(target=advance_ledger_clock, args=(pg_ledger.engine, 601))
            mover.start()
            wait_for(lambda: _waiting_on_a_lock(pg_ledger), 10, interval_s=0.01, what="the move waiting for the row")
        mover.join(10)
        assert not mover.is_alive()
    finally:
        writer.dispose()
    with pg_ledger.sessions() as s:
        left = s.execute(select(Operation.next_attempt_at - db_now()).where(Operation.id == op_id)).scalar_one()
    # Written as "in 6000 s", then 601 s passed (a lost update would have made it due long ago).
    assert dt.timedelta(seconds=5390) < left <= dt.timedelta(seconds=5399)


def _waiting_on_a_lock(ledger) -> bool:
    with ledger.engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, True, "5"])
def test_the_clock_moves_forward_by_a_finite_number_of_seconds_only(ledger, bad):
    with pytest.raises(ValueError):
        advance_ledger_clock(ledger.engine, bad)
    assert advance_ledger_clock(ledger.engine, 0) == 0


def test_no_product_code_imports_the_test_helpers():
    root = Path(__file__).resolve().parents[3]
    pattern = re.compile(
        r"^\s*(from\s+outbox\.testing\s|import\s+outbox\.testing|from\s+outbox\s+import\s.*\btesting\b)"
    )
    offenders = [
        str(path.relative_to(root))
        for package in ("outbox", "workers", "breaker", "producer", "bench", "examples")
        for path in (root / package).rglob("*.py")
        if path != root / "outbox" / "testing.py"
        for line in path.read_text().splitlines()
        if pattern.match(line)
    ]
    assert offenders == []
