"""Conformance: the rows beside an operation's own (attempt_log, insert_evidence, insert_run). See
conftest.py for how to run this against a new driver."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import select

from outbox.ledger.models import Evidence, Run, core_table
from outbox.ledger.states import AttemptClass, AttemptKind, Status

EVIDENCE = core_table(Evidence)
RUN = core_table(Run)
LOG_COLUMNS = ("id", "operation_id", "attempt_number", "kind", "fencing_token", "attempt_class", "provider_reference")


def test_attempt_log_lists_the_asked_columns_of_the_operations_attempts_in_id_order(case):
    op_id, other = case.submit(), case.submit()
    first = case.claim_one(op_id)
    case.finalize(case.write(first, Status.OUTCOME_UNKNOWN, AttemptClass.AMBIGUOUS))
    lookup = case.claim_one(op_id, AttemptKind.LOOKUP)
    case.claim_one(other)
    with case.sessions() as s:
        rows = case.driver.attempt_log(s, [op_id], LOG_COLUMNS)
        assert case.driver.attempt_log(s, [], LOG_COLUMNS) == []
        both = case.driver.attempt_log(s, [op_id, other], ("id", "operation_id"))
    assert [tuple(r) for r in rows] == [
        (first.attempt_id, op_id, 1, "dispatch", first.fencing_token, "ambiguous", None),
        (lookup.attempt_id, op_id, 1, "lookup", lookup.fencing_token, "pending", None),
    ]
    assert [r.attempt_class for r in rows] == ["ambiguous", "pending"], "columns by name too"
    assert [r.id for r in both] == sorted(r.id for r in both) and {r.operation_id for r in both} == {op_id, other}


def evidence(op_id: str, n: int) -> dict[str, Any]:
    return {
        "operation_id": op_id,
        "tenant": "t",
        "idempotency_key": f"key-{n}",
        "action": "payments.refund.create",
        "args_digest": "d" * 64,
        "provider_reference": f"re_{n}",
        "response_digest": "r" * 64,
        "attempt_log_digest": "l" * 64,
    }


def test_insert_evidence_appends_every_record_on_the_database_clock(case):
    op_id = case.submit()
    before = case.db_time()
    with case.sessions.begin() as s:
        case.driver.insert_evidence(s, [evidence(op_id, 1), evidence(op_id, 2)])
    with case.sessions.begin() as s:
        case.driver.insert_evidence(s, [evidence(op_id, 1)])  # append-only: a repeat is another row
    with case.sessions() as s:
        rows = s.execute(select(EVIDENCE).order_by(EVIDENCE.c.id)).all()
    assert [r.provider_reference for r in rows] == ["re_1", "re_2", "re_1"]
    assert {k: getattr(rows[1], k) for k in evidence(op_id, 2)} == evidence(op_id, 2)
    assert all(0 <= case.seconds(r.recorded_at, before) < 5 for r in rows)


def test_insert_evidence_of_no_records_writes_nothing(case):
    with case.sessions.begin() as s:
        case.driver.insert_evidence(s, [])
    with case.sessions() as s:
        assert s.execute(select(EVIDENCE)).all() == []


def run_values(tenant: str, run_key: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    return {
        "id": str(uuid.uuid4()),
        "tenant": tenant,
        "run_key": run_key,
        "subject": "agent",
        "status": "running",
        "spec_digest": "s" * 64,
        "history": [],
        "created_at": now,
        "updated_at": now,
    }


def test_insert_run_inserts_once_per_tenant_and_run_key(case):
    first, replay, elsewhere = run_values("t", "r1"), run_values("t", "r1"), run_values("u", "r1")
    with case.sessions.begin() as s:
        assert case.driver.insert_run(s, first) is True
    with case.sessions.begin() as s:
        assert case.driver.insert_run(s, replay) is False
        assert case.driver.insert_run(s, elsewhere) is True
    with case.sessions() as s:
        rows = s.execute(select(RUN.c.id, RUN.c.tenant).order_by(RUN.c.tenant)).all()
    assert [tuple(r) for r in rows] == [(first["id"], "t"), (elsewhere["id"], "u")], "the replay wrote nothing"


def test_upsert_is_an_insert_that_skips_or_updates_a_conflicting_row(case):
    first, replay = run_values("t", "r-up"), run_values("t", "r-up")
    skip = case.driver.upsert(RUN).values(first).on_conflict_do_nothing(index_elements=["tenant", "run_key"])
    with case.sessions.begin() as s:
        assert s.execute(skip.returning(RUN.c.id)).first() is not None, "no conflict: inserted"
    again = case.driver.upsert(RUN).values(replay).on_conflict_do_nothing(index_elements=["tenant", "run_key"])
    with case.sessions.begin() as s:
        assert s.execute(again.returning(RUN.c.id)).first() is None, "a conflict: skipped"
    stmt = case.driver.upsert(RUN).values(replay)
    bump = stmt.on_conflict_do_update(index_elements=["tenant", "run_key"], set_={"subject": "updated"})
    with case.sessions.begin() as s:
        assert s.execute(bump.returning(RUN.c.id)).scalar_one() == first["id"], "the existing row, updated"
    with case.sessions() as s:
        rows = s.execute(select(RUN.c.id, RUN.c.subject).where(RUN.c.run_key == "r-up")).all()
    assert [tuple(r) for r in rows] == [(first["id"], "updated")]
