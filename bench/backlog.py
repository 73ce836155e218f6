"""The backlog both loops drain: M due ``not_dispatched`` rows, in the ledger and in a bare twin.

``bare_operations`` is ``CREATE TABLE ... (LIKE outbox_operations INCLUDING ALL)``: the same columns,
defaults, CHECK constraints, primary key, unique key and the same partial indexes, so the bare
loop pays the same index maintenance per UPDATE as the ledger does. It has no foreign keys
pointing at it and no attempt or event rows: that difference is what the comparison measures.

Rows are written by one INSERT ... SELECT (not by ``submit``): filling is not what is measured,
and the values match what ``submit`` writes for a due intent.
"""

from __future__ import annotations

import psycopg

from outbox.ledger.models import OPERATIONS

LEDGER_TABLE = OPERATIONS
BARE_TABLE = "bare_operations"

_FILL = """
INSERT INTO {table} (
    id, tenant, idempotency_key, action, args, args_digest, subject, status, reason,
    fencing_token, attempt_count, max_attempts, deadline_at, next_attempt_at,
    cancel_requested, proven_absent_through, created_at, updated_at)
SELECT gen_random_uuid()::text, 'bench', 'backlog-' || %(batch)s || '-' || g, 'refund',
       '{{"amount":"12.50","currency":"eur","order_id":"ord-' || g || '"}}',
       md5(g::text) || md5(g::text), 'agent-bench', 'not_dispatched', 'submitted',
       0, 0, 5, now() + interval '1 hour',
       -- Distinct due times, oldest first, all in the past: every row is due at once.
       now() - interval '1 hour' + g * interval '1 millisecond',
       false, 0, now(), now()
FROM generate_series(1, %(m)s) AS g
"""


def create_bare_table(conn: psycopg.Connection) -> None:
    conn.execute(f"CREATE TABLE {BARE_TABLE} (LIKE {LEDGER_TABLE} INCLUDING ALL)")


def refill(conn: psycopg.Connection, table: str, m: int, batch: str) -> None:
    """Empty ``table`` (and, for the ledger, its attempts and events), then add ``m`` due rows.

    Truncating before each run gives every run the same fresh heap and indexes (the server runs
    with autovacuum off, so dead tuples from an earlier run would otherwise slow the next one).
    """
    if table == LEDGER_TABLE:
        conn.execute(f"TRUNCATE {LEDGER_TABLE} RESTART IDENTITY CASCADE")  # and every table that refers to it
    else:
        conn.execute(f"TRUNCATE {table}")
    conn.execute(_FILL.format(table=table), {"m": m, "batch": batch})
    conn.execute(f"ANALYZE {table}")
