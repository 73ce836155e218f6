"""A doorbell's claim is one statement text whatever the split of its batch between the rung ids and
other due rows (outbox/ledger/drivers/pg_statements.py ``claim``, ``ids_fit``): psycopg prepares it
once per connection and PostgreSQL keeps its plan, instead of planning every split afresh."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy.orm import Session

from outbox.ledger.claims import claim_due
from producer import submit

# The claims' prepared statements on a connection (this read's own text names walk_on: not counted).
PREPARED_CLAIMS = (
    "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%walk_on%%'"
    " AND statement NOT LIKE '%%pg_prepared_statements%%'"
)


def _due(ledger, prefix: str, n: int) -> list[str]:
    """``n`` refund intents of tenant acme, due now; their operation ids."""
    with ledger.sessions.begin() as s:
        return [
            submit(
                s,
                tenant="acme",
                idempotency_key=f"{prefix}-{k}",
                action="payments.refund.create",
                args={"order_id": f"o-{k}", "amount": Decimal("1.00"), "currency": "EUR"},
                subject="agent:bot",
            ).operation_id
            for k in range(n)
        ]


def test_every_split_of_a_doorbells_batch_runs_one_prepared_statement(pg_ledger):
    ids = _due(pg_ledger, "shape", 200)
    with pg_ledger.engine.connect() as conn:
        # Every split of a batch of 10, twice: each split alone runs twice, below psycopg's threshold
        # of 5. Committed, not rolled back: psycopg forgets every prepared statement on a ROLLBACK.
        for n in range(18):
            given = 1 + n % 9
            wanted, ids = ids[:given], ids[given:]
            with Session(bind=conn) as session:
                claims = claim_due(
                    session, worker="w", lease_s=30, operation_ids=wanted, limit=given, also_due=10 - given
                )
                session.commit()
            taken = {c.operation_id for c in claims}
            assert len(claims) == 10 and taken >= set(wanted)
            ids = [i for i in ids if i not in taken]
        prepared = conn.exec_driver_sql(PREPARED_CLAIMS).scalar_one()
    assert prepared == 1


def test_a_workers_hot_path_prepares_each_claim_text_at_its_first_run(pg_ledger):
    """On a worker's own connection (LedgerConnection, PgHotPath) a statement is prepared the first
    time it runs, not at psycopg's fifth: until then PostgreSQL plans it on every run, and a claim
    costs more to plan (1.3-2.5 ms) than to run. Under a CPU quota, with doorbells of every size,
    up to 45% of claims were planned (issue 56; bench/README.md)."""
    from outbox.ledger.hot_path import LedgerConnection

    _due(pg_ledger, "first", 6)
    ledger = LedgerConnection(pg_ledger.engine, pg_ledger.sessions)
    try:
        for limit in (1, 2, 3):  # three texts (the limit is a literal), each run once
            with ledger.one_statement() as conn:
                assert len(claim_due(conn, worker="w", lease_s=30.0, limit=limit)) == limit
        with ledger.one_statement() as conn:
            prepared = conn.execute(PREPARED_CLAIMS).fetchone()[0]
    finally:
        ledger.close()
    assert prepared == 3
