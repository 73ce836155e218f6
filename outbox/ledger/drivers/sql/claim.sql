-- The claims: a worker takes due operations (a dispatch) or a reconciler takes operations whose
-- outcome is unknown (a lookup), each in ONE statement. Read by outbox/ledger/drivers/pg_statements.py.
--
-- File format: a block starts at "-- name: <query_name>"; the comment lines after it say what the
-- query is for. Whole-line comments are for the reader and are not sent to the server.
--
-- Parameters: psycopg's %(name)s (pg_statements.named gives SQLAlchemy's :name for a caller's
-- transaction on another driver), so a cast next to a parameter is CAST(%(x)s AS type), never
-- %(x)s::type.
--
-- Placeholders, filled in by Python before the text is sent, always with integers:
--   {limit}   how many rows the claim takes (of the given ids, or of any due rows);
--   {others}  how many due rows besides the given ids;
--   {wanted}  how many of the given ids the tenants' walk reads (the claim's whole size when the
--             ids fit in it: then every split of one batch between given ids and other rows is
--             one text, which psycopg prepares once and PostgreSQL plans once);
--   {take}    the whole claim of the tenants' walk (given ids and other due rows together).
-- Statuses and LIMITs are literals, never parameters: psycopg prepares a statement after a few
-- executions, and only then can PostgreSQL keep one generic plan for it. With the status as a
-- parameter the generic plan cannot use the partial index of that status, and with LIMIT as a
-- parameter it is costed for 10% of the table: PostgreSQL re-planned every claim, and planning
-- cost as much as running it.
--
-- Every claim has the same tail, after the CTE "due" (its rows and their rank):
--   claimed   locks nothing more: bumps the fencing token and the lease of the rows "due" locked
--             (FOR UPDATE SKIP LOCKED), and a dispatch moves them to dispatching;
--   numbered  numbers the attempt, and says whether an earlier attempt may have taken effect
--             (outbox/ledger/effect_guard.py) and, for a dispatch with nothing on record, the
--             action versions the earlier attempts that may have left were built under
--             (outbox/ledger/request_record.py);
--   opened    opens the attempt row, which records the claim's event too (its id from the events'
--             sequence, the status claimed from: outbox_history shows it as an event row).
-- The CTEs read attempts as of the statement's snapshot, so numbering and the ambiguity check see
-- the rows committed before this claim.
--
-- A dispatch's attempt row records the version of its action the worker holds: %(versions)s, a
-- JSON object action -> version (one parameter for the batch).
--
-- The tenants' walk (the dispatch claims of due rows; outbox/ledger/fairness.py says what is
-- shared and why). walk_on and walk_wrapped list the tenants with rows due, in the order they are
-- served this time: those after the cursor tenant (%(after_tenant)s, the last one this process
-- served, '' at first), then from the first up to the cursor; at most 32 (each costs one probe of
-- the fair index, and a claim of up to 100 rows rarely serves more than a few dozen tenants). One
-- probe per tenant (a loose index scan), not a scan of every row of a big tenant; a probe passes
-- over a tenant's rows not due yet, so tenants past the 32nd are reached. n: the tenant's place in
-- this claim's round. weighted: the walked tenants' weights (%(weight_tenants)s and %(weights)s,
-- the tenants weighted other than 1).
-- Each walked tenant's due rows are read in its order (priority DESC, next_attempt_at:
-- ix_outbox_operations_fair_due), up to the whole claim (a lone tenant fills it), locked as they
-- are read; a doorbell's given ids of that tenant take its first turns. Then every candidate is
-- ranked: a fair claim by its turn over its tenant's weight, ties in the round's tenant order, so
-- each tenant with work due gets its share and one tenant's backlog cannot fill the claim; a claim
-- without fairness puts the given ids first, then priority and age whoever the tenant.
-- ix_outbox_operations_due cannot give a tenant's order (it is by time alone), so no plan reads it
-- filtering on the tenant; when it could, a generic plan did, statistics taken before a second
-- tenant's first rows making the tenant look unselective: 15 ms a claim behind a 20k backlog.
--
-- Due rows are bounded by statement_timestamp() where the due index must answer the bound (else
-- each claim reads the index's every dead entry: outbox/ledger/clock.py db_scan_now), by
-- clock_timestamp() where given ids are found through the primary key and the bound only filters.


-- name: claim_dispatch_due
-- A worker's claim of {limit} due rows, walking the tenants from the cursor, without fairness:
-- by priority and age whoever the tenant.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
),
weighted AS (
    SELECT w.tenant, w.n, coalesce((SELECT u.weight FROM unnest(CAST(%(weight_tenants)s AS varchar[]),
        CAST(%(weights)s AS float8[])) AS u(tenant, weight) WHERE u.tenant = w.tenant LIMIT 1), 1) AS weight
    FROM walk w
),
-- No given ids: "wanted" finds none.
wanted AS (
    SELECT id, tenant, priority, next_attempt_at,
        row_number() OVER (PARTITION BY tenant ORDER BY priority DESC, next_attempt_at) AS turn FROM (
        SELECT id, tenant, priority, next_attempt_at FROM outbox_operations
        WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND false
        ORDER BY priority DESC, next_attempt_at  -- more ids than wanted: the first in claim order, not whichever the plan meets
        LIMIT 0
        FOR UPDATE SKIP LOCKED) given
), candidates AS (
    SELECT id, tenant, turn, 1 AS given, priority, next_attempt_at FROM wanted
    UNION ALL
    SELECT c.id, t.tenant, c.turn + coalesce((SELECT count(*) FROM wanted WHERE wanted.tenant = t.tenant), 0),
        0, c.priority, c.next_attempt_at
    FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at, row_number() OVER (ORDER BY priority DESC, next_attempt_at) AS turn FROM (
            SELECT id, priority, next_attempt_at FROM outbox_operations o
            WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp()
            ORDER BY priority DESC, next_attempt_at
            LIMIT {limit}
            FOR UPDATE SKIP LOCKED) due_of_tenant
    ) c
), due AS (
    SELECT c.id, row_number() OVER (ORDER BY c.given DESC, c.priority DESC, c.next_attempt_at) AS rank
    FROM candidates c LEFT JOIN weighted wt ON wt.tenant = c.tenant
    ORDER BY rank
    LIMIT {limit}
), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp(),
        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed', waiting_for = NULL
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'dispatch') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CASE WHEN c.request_version IS NULL AND c.attempt_count > 1 THEN
            (SELECT string_agg(DISTINCT coalesce(a.action_version, c.action_version, ''), ',') FROM outbox_attempts a
             WHERE a.operation_id = c.id AND a.kind = 'dispatch' AND a.attempt_class <> 'not_sent'
               AND a.attempt_number > c.proven_absent_through)
        END AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'dispatch', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), 'not_dispatched', CAST(%(versions)s AS json) ->> action
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_dispatch_due_fair
-- claim_dispatch_due, fair: the due rows shared among the walked tenants by their weights.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
),
weighted AS (
    SELECT w.tenant, w.n, coalesce((SELECT u.weight FROM unnest(CAST(%(weight_tenants)s AS varchar[]),
        CAST(%(weights)s AS float8[])) AS u(tenant, weight) WHERE u.tenant = w.tenant LIMIT 1), 1) AS weight
    FROM walk w
),
-- No given ids: "wanted" finds none.
wanted AS (
    SELECT id, tenant, priority, next_attempt_at,
        row_number() OVER (PARTITION BY tenant ORDER BY priority DESC, next_attempt_at) AS turn FROM (
        SELECT id, tenant, priority, next_attempt_at FROM outbox_operations
        WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND false
        ORDER BY priority DESC, next_attempt_at  -- more ids than wanted: the first in claim order, not whichever the plan meets
        LIMIT 0
        FOR UPDATE SKIP LOCKED) given
), candidates AS (
    SELECT id, tenant, turn, 1 AS given, priority, next_attempt_at FROM wanted
    UNION ALL
    SELECT c.id, t.tenant, c.turn + coalesce((SELECT count(*) FROM wanted WHERE wanted.tenant = t.tenant), 0),
        0, c.priority, c.next_attempt_at
    FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at, row_number() OVER (ORDER BY priority DESC, next_attempt_at) AS turn FROM (
            SELECT id, priority, next_attempt_at FROM outbox_operations o
            WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp()
            ORDER BY priority DESC, next_attempt_at
            LIMIT {limit}
            FOR UPDATE SKIP LOCKED) due_of_tenant
    ) c
), due AS (
    SELECT c.id, row_number() OVER (ORDER BY c.turn / coalesce(wt.weight, 1), c.tenant <= CAST(%(after_tenant)s AS varchar), c.tenant) AS rank
    FROM candidates c LEFT JOIN weighted wt ON wt.tenant = c.tenant
    ORDER BY rank
    LIMIT {limit}
), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp(),
        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed', waiting_for = NULL
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'dispatch') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CASE WHEN c.request_version IS NULL AND c.attempt_count > 1 THEN
            (SELECT string_agg(DISTINCT coalesce(a.action_version, c.action_version, ''), ',') FROM outbox_attempts a
             WHERE a.operation_id = c.id AND a.kind = 'dispatch' AND a.attempt_class <> 'not_sent'
               AND a.attempt_number > c.proven_absent_through)
        END AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'dispatch', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), 'not_dispatched', CAST(%(versions)s AS json) ->> action
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_dispatch_given_then_due
-- A doorbell's claim: its due ids (%(operation_ids)s, up to {wanted}) first, then other due rows
-- walking the tenants, {take} in all; without fairness: by priority and age whoever the tenant.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
),
weighted AS (
    SELECT w.tenant, w.n, coalesce((SELECT u.weight FROM unnest(CAST(%(weight_tenants)s AS varchar[]),
        CAST(%(weights)s AS float8[])) AS u(tenant, weight) WHERE u.tenant = w.tenant LIMIT 1), 1) AS weight
    FROM walk w
),
wanted AS (
    SELECT id, tenant, priority, next_attempt_at,
        row_number() OVER (PARTITION BY tenant ORDER BY priority DESC, next_attempt_at) AS turn FROM (
        SELECT id, tenant, priority, next_attempt_at FROM outbox_operations
        WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND id = ANY(CAST(%(operation_ids)s AS varchar[]))
        ORDER BY priority DESC, next_attempt_at  -- more ids than wanted: the first in claim order, not whichever the plan meets
        LIMIT {wanted}
        FOR UPDATE SKIP LOCKED) given
), candidates AS (
    SELECT id, tenant, turn, 1 AS given, priority, next_attempt_at FROM wanted
    UNION ALL
    SELECT c.id, t.tenant, c.turn + coalesce((SELECT count(*) FROM wanted WHERE wanted.tenant = t.tenant), 0),
        0, c.priority, c.next_attempt_at
    FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at, row_number() OVER (ORDER BY priority DESC, next_attempt_at) AS turn FROM (
            SELECT id, priority, next_attempt_at FROM outbox_operations o
            WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp() AND NOT (id = ANY(CAST(%(operation_ids)s AS varchar[])))
            ORDER BY priority DESC, next_attempt_at
            LIMIT {take}
            FOR UPDATE SKIP LOCKED) due_of_tenant
    ) c
), due AS (
    SELECT c.id, row_number() OVER (ORDER BY c.given DESC, c.priority DESC, c.next_attempt_at) AS rank
    FROM candidates c LEFT JOIN weighted wt ON wt.tenant = c.tenant
    ORDER BY rank
    LIMIT {take}
), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp(),
        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed', waiting_for = NULL
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'dispatch') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CASE WHEN c.request_version IS NULL AND c.attempt_count > 1 THEN
            (SELECT string_agg(DISTINCT coalesce(a.action_version, c.action_version, ''), ',') FROM outbox_attempts a
             WHERE a.operation_id = c.id AND a.kind = 'dispatch' AND a.attempt_class <> 'not_sent'
               AND a.attempt_number > c.proven_absent_through)
        END AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'dispatch', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), 'not_dispatched', CAST(%(versions)s AS json) ->> action
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_dispatch_given_then_due_fair
-- claim_dispatch_given_then_due, fair: the given ids take their own tenant's first turns, and the
-- claim is shared among the walked tenants by their weights.
WITH RECURSIVE
walk_on(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant > CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp()
            AND o.tenant > w.tenant ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_on w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk_wrapped(tenant, n) AS (
    SELECT (SELECT tenant FROM outbox_operations WHERE status = 'not_dispatched' AND next_attempt_at <= statement_timestamp()
            AND tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY tenant LIMIT 1), (SELECT count(tenant) FROM walk_on) + 1
  UNION ALL
    SELECT (SELECT o.tenant FROM outbox_operations o WHERE o.status = 'not_dispatched' AND o.next_attempt_at <= statement_timestamp() AND o.tenant > w.tenant
              AND o.tenant <= CAST(%(after_tenant)s AS varchar) ORDER BY o.tenant LIMIT 1), w.n + 1
    FROM walk_wrapped w WHERE w.tenant IS NOT NULL AND w.n < 32
), walk AS (
    SELECT tenant, n FROM walk_on WHERE tenant IS NOT NULL
    UNION ALL SELECT tenant, n FROM walk_wrapped WHERE tenant IS NOT NULL AND n <= 32
),
weighted AS (
    SELECT w.tenant, w.n, coalesce((SELECT u.weight FROM unnest(CAST(%(weight_tenants)s AS varchar[]),
        CAST(%(weights)s AS float8[])) AS u(tenant, weight) WHERE u.tenant = w.tenant LIMIT 1), 1) AS weight
    FROM walk w
),
wanted AS (
    SELECT id, tenant, priority, next_attempt_at,
        row_number() OVER (PARTITION BY tenant ORDER BY priority DESC, next_attempt_at) AS turn FROM (
        SELECT id, tenant, priority, next_attempt_at FROM outbox_operations
        WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND id = ANY(CAST(%(operation_ids)s AS varchar[]))
        ORDER BY priority DESC, next_attempt_at  -- more ids than wanted: the first in claim order, not whichever the plan meets
        LIMIT {wanted}
        FOR UPDATE SKIP LOCKED) given
), candidates AS (
    SELECT id, tenant, turn, 1 AS given, priority, next_attempt_at FROM wanted
    UNION ALL
    SELECT c.id, t.tenant, c.turn + coalesce((SELECT count(*) FROM wanted WHERE wanted.tenant = t.tenant), 0),
        0, c.priority, c.next_attempt_at
    FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at, row_number() OVER (ORDER BY priority DESC, next_attempt_at) AS turn FROM (
            SELECT id, priority, next_attempt_at FROM outbox_operations o
            WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp() AND NOT (id = ANY(CAST(%(operation_ids)s AS varchar[])))
            ORDER BY priority DESC, next_attempt_at
            LIMIT {take}
            FOR UPDATE SKIP LOCKED) due_of_tenant
    ) c
), due AS (
    SELECT c.id, row_number() OVER (ORDER BY c.turn / coalesce(wt.weight, 1), c.tenant <= CAST(%(after_tenant)s AS varchar), c.tenant) AS rank
    FROM candidates c LEFT JOIN weighted wt ON wt.tenant = c.tenant
    ORDER BY rank
    LIMIT {take}
), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp(),
        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed', waiting_for = NULL
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'dispatch') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CASE WHEN c.request_version IS NULL AND c.attempt_count > 1 THEN
            (SELECT string_agg(DISTINCT coalesce(a.action_version, c.action_version, ''), ',') FROM outbox_attempts a
             WHERE a.operation_id = c.id AND a.kind = 'dispatch' AND a.attempt_class <> 'not_sent'
               AND a.attempt_number > c.proven_absent_through)
        END AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'dispatch', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), 'not_dispatched', CAST(%(versions)s AS json) ->> action
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_dispatch_given
-- A doorbell's claim of its own due ids only (%(operation_ids)s, up to {limit}), in claim order;
-- no walk: the ids bound their own rows.
WITH wanted AS (
    SELECT id, 0 AS rank FROM outbox_operations
    WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND id = ANY(CAST(%(operation_ids)s AS varchar[]))
    ORDER BY priority DESC, next_attempt_at
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
), due AS (SELECT id, rank FROM wanted), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp(),
        status = 'dispatching', attempt_count = o.attempt_count + 1, reason = 'claimed', waiting_for = NULL
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'dispatch') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CASE WHEN c.request_version IS NULL AND c.attempt_count > 1 THEN
            (SELECT string_agg(DISTINCT coalesce(a.action_version, c.action_version, ''), ',') FROM outbox_attempts a
             WHERE a.operation_id = c.id AND a.kind = 'dispatch' AND a.attempt_class <> 'not_sent'
               AND a.attempt_number > c.proven_absent_through)
        END AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'dispatch', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), 'not_dispatched', CAST(%(versions)s AS json) ->> action
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_lookups_due
-- A reconciler's claim of {limit} operations due for a lookup (outcome_unknown or accepted, no
-- live lease), oldest first. A lookup keeps its row's status: its attempt's claimed_from says which.
WITH due AS (
    SELECT id, 1 AS rank FROM outbox_operations
    WHERE status IN ('accepted', 'outcome_unknown') AND next_attempt_at <= statement_timestamp()
      AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
    ORDER BY next_attempt_at
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp()
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'lookup') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CAST(NULL AS text) AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'lookup', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), status, NULL
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_lookups_given
-- A doorbell's lookup claim of its own due ids only (%(operation_ids)s, up to {limit}).
WITH wanted AS (
    SELECT id, 0 AS rank FROM outbox_operations
    WHERE status IN ('accepted', 'outcome_unknown') AND next_attempt_at <= clock_timestamp()
      AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
      AND id = ANY(CAST(%(operation_ids)s AS varchar[]))
    ORDER BY next_attempt_at
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
), due AS (SELECT id, rank FROM wanted), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp()
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'lookup') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CAST(NULL AS text) AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'lookup', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), status, NULL
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: claim_lookups_given_then_due
-- A doorbell's lookup claim: its due ids (%(operation_ids)s, up to {limit}) first, then up to
-- {others} other operations due for a lookup, oldest first.
WITH wanted AS (
    SELECT id, 0 AS rank FROM outbox_operations
    WHERE status IN ('accepted', 'outcome_unknown') AND next_attempt_at <= clock_timestamp()
      AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
      AND id = ANY(CAST(%(operation_ids)s AS varchar[]))
    ORDER BY next_attempt_at
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED
), others AS (
    SELECT id, 1 AS rank FROM outbox_operations
    WHERE status IN ('accepted', 'outcome_unknown') AND next_attempt_at <= statement_timestamp()
      AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())
      AND NOT (id = ANY(CAST(%(operation_ids)s AS varchar[])))
    ORDER BY next_attempt_at
    LIMIT {others}
    FOR UPDATE SKIP LOCKED
), due AS (SELECT id, rank FROM wanted UNION ALL SELECT id, rank FROM others), claimed AS (
    UPDATE outbox_operations o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = %(worker)s,
        lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_s)s),
        updated_at = clock_timestamp()
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM outbox_attempts a
          WHERE a.operation_id = c.id AND a.kind = 'lookup') AS number,
        EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = c.id
                AND (a.attempt_class = 'succeeded'
                     OR (a.kind = 'dispatch' AND a.attempt_number > c.proven_absent_through
                         AND a.attempt_class IN ('ambiguous', 'pending')))) AS open_ambiguity,
        CAST(NULL AS text) AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO outbox_attempts (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, 'lookup', fencing_token, %(worker)s, clock_timestamp(), 'pending', false,
        nextval('outbox_operation_events_id_seq'), status, NULL
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank


-- name: read_due
-- A doorbell's first read: which of its ids (%(ids)s) are due now, with what a deadline check needs.
SELECT id, action, created_at, deadline_at, max_attempts, attempt_count, clock_timestamp() AS db_now
FROM outbox_operations
WHERE id = ANY(%(ids)s) AND status = 'not_dispatched' AND next_attempt_at <= clock_timestamp()
