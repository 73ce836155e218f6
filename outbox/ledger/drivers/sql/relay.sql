-- The relay: which due operations to ring a doorbell for (publish to the broker), and the NOTIFY
-- path. Read by outbox/ledger/drivers/pg_statements.py; the file format is claim.sql's.
--
-- Placeholders, filled in by Python before the text is sent:
--   {batch}   how many rows one statement marks (an integer);
--   {status}  the status whose due rows are marked (outcome_unknown or accepted), a literal.
--
-- The mark_due queries mark up to {batch} due rows published and answer (id, seconds since due),
-- in their own transaction; SKIP LOCKED: two marking relays never mark the same rows in the same
-- window. A relay that can read the broker's depth rings by count and sends them read only
-- (pg_statements._read_only: the same rows, no mark, no lock; two relays may then name the same
-- rows, which is harmless: the claim decides).
-- A row is rung when it was never published and is older than %(fresh_grace_s)s (younger ones are
-- left to the NOTIFY path) unless it was due before %(leading_since)s (NULL unless this relay
-- leads the NOTIFY path) or was claimed before (fencing_token > 0: a retry coming due, which no
-- NOTIFY announces); when it is due again since it was published (a retry); or when it was
-- published longer than %(republish_after_s)s ago (the broker may have lost it).
-- The *_lease_free queries also leave out rows under a live lease.


-- name: mark_due_by_tenant
-- Due not_dispatched rows, rung in the claim's order within each tenant (higher priority first),
-- walking the tenants as a claim does (claim.sql), from the first: the order by time alone would
-- ring a tenant's old low priorities first, and a doorbell's ids take their tenant's first turns
-- in the claim.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > '' ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= '' ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= '' ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
), due AS (
    SELECT d.id FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at FROM outbox_operations
        WHERE tenant = t.tenant AND status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
          AND ((published_at IS NULL AND (fencing_token > 0 OR next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                          OR next_attempt_at < CAST(%(leading_since)s AS timestamptz)))
               OR published_at < next_attempt_at
               OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
        ORDER BY priority DESC, next_attempt_at
        LIMIT {batch}
        FOR UPDATE SKIP LOCKED) d
    ORDER BY d.priority DESC, d.next_attempt_at
    LIMIT {batch}
)
UPDATE outbox_operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8


-- name: mark_due_by_tenant_lease_free
-- mark_due_by_tenant, leaving out rows under a live lease.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > '' ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= '' ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= '' ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
), due AS (
    SELECT d.id FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at FROM outbox_operations
        WHERE tenant = t.tenant AND status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
          AND ((published_at IS NULL AND (fencing_token > 0 OR next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                          OR next_attempt_at < CAST(%(leading_since)s AS timestamptz)))
               OR published_at < next_attempt_at
               OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
          AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
        ORDER BY priority DESC, next_attempt_at
        LIMIT {batch}
        FOR UPDATE SKIP LOCKED) d
    ORDER BY d.priority DESC, d.next_attempt_at
    LIMIT {batch}
)
UPDATE outbox_operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8


-- name: mark_due
-- Due rows of {status}, oldest first.
WITH due AS (
    SELECT id FROM outbox_operations
    WHERE status = '{status}' AND next_attempt_at <= statement_timestamp()
      AND ((published_at IS NULL AND (fencing_token > 0 OR next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                      OR next_attempt_at < CAST(%(leading_since)s AS timestamptz)))
           OR published_at < next_attempt_at
           OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
    ORDER BY next_attempt_at
    LIMIT {batch}
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8


-- name: mark_due_lease_free
-- mark_due, leaving out rows under a live lease (a lookup under way keeps its row due until it is
-- settled).
WITH due AS (
    SELECT id FROM outbox_operations
    WHERE status = '{status}' AND next_attempt_at <= statement_timestamp()
      AND ((published_at IS NULL AND (fencing_token > 0 OR next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                      OR next_attempt_at < CAST(%(leading_since)s AS timestamptz)))
           OR published_at < next_attempt_at
           OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
      AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
    ORDER BY next_attempt_at
    LIMIT {batch}
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8


-- name: mark_rung
-- The ids rung from NOTIFY (%(ids)s) that nobody has claimed yet are published now.
UPDATE outbox_operations SET published_at = clock_timestamp()
WHERE id = ANY(%(ids)s) AND status = 'not_dispatched' AND published_at IS NULL


-- name: listen
-- The relay's LISTEN connection: submit_notify and notify_due (submit.sql) notify here.
LISTEN outbox_due


-- name: try_lead
-- The NOTIFY-leader lock (%(key)s): a session-level lock, released when the connection ends, so a
-- standby takes over. The clock is read after LISTEN began: a row due later commits later, so it
-- is notified.
SELECT pg_try_advisory_lock(%(key)s), clock_timestamp()
