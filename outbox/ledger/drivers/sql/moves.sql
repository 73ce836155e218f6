-- The fenced moves: a worker's finalize (its attempt's result) and a reconciler's settlement (its
-- lookup's), one operation per statement or, for a doorbell's moves that are alike, many in one
-- (the *_rows queries). Read by outbox/ledger/drivers/pg_moves.py; the file format is claim.sql's.
--
-- Placeholders, filled in by Python before the text is sent:
--   {writes}  what the move writes on the operation row: the move's write set, spelled once in
--             outbox/ledger/writes.py for both drivers and rendered as a SET list (pg_moves.render).
--             For a worker's success, e.g.:
--               status = %(to)s, updated_at = clock_timestamp(),
--               reason = CASE WHEN cancel_requested THEN %(reason)s || ' (completed after cancel requested)' ELSE %(reason)s END,
--               waiting_for = %(waiting_for)s, lease_owner = NULL, lease_expires_at = NULL,
--               result_reference = %(provider_reference)s, result_digest = %(response_digest)s,
--               result = CAST(%(result)s AS json), error_class = NULL,
--               request_version = CASE WHEN request_version IS NULL THEN CAST(%(sent_version)s AS text) ELSE request_version END,
--               ... (the rest of the request on record, likewise), finished_at = clock_timestamp()
--             and in the *_rows queries the same with v.p_<name> for %(<name>)s;
--   {source}  the status a settlement moves from, outcome_unknown or accepted: written in as a
--             literal, as every status is (claim.sql says why).
--
-- Each statement makes the fenced move (WHERE status and fencing_token: a worker whose lease was
-- taken over matches no row) and writes the attempt row's report, which records the move's event
-- when it moved (outbox_history shows it). An event row is written only if the attempt row was
-- already ended: then nothing else would say the operation moved. It answers (wrote, moved): the
-- attempt row written, the operation moved.


-- name: finalize
-- A worker's finalize: its dispatching operation moved to %(to)s, its attempt row's report.
WITH moved AS (
    UPDATE outbox_operations SET {writes}
    WHERE id = %(operation_id)s AND status = 'dispatching' AND fencing_token = %(token)s
    RETURNING id, fencing_token
), att AS (
    UPDATE outbox_attempts SET ended_at = clock_timestamp(), attempt_class = %(klass)s, status_code = %(status_code)s,
        request_digest = %(request_digest)s, provider_request_id = %(provider_request_id)s,
        provider_reference = %(provider_reference)s, response_digest = %(response_digest)s,
        retry_after_s = %(retry_after_s)s, latency_s = %(latency_s)s, error = %(error)s, stale = %(stale)s,
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('outbox_operation_events_id_seq'), CAST(%(to)s AS varchar), CAST(%(event_reason)s AS text) FROM moved)
    WHERE id = %(attempt_id)s AND ended_at IS NULL
    RETURNING id
), logged AS (
    INSERT INTO outbox_operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), 'dispatching', %(to)s, fencing_token, %(event)s, %(event_reason)s, %(actor)s
    FROM moved WHERE NOT EXISTS (SELECT 1 FROM att)
)
SELECT (SELECT count(*) FROM att) AS wrote, (SELECT count(*) FROM moved) AS moved


-- name: finalize_if_no_effect
-- finalize for a move that claims "no effect happened" (failed_before_commit, cancelled): it holds
-- only while no other attempt of the operation may have taken effect (outbox/ledger/effect_guard.py;
-- %(attempt_id)s, the worker's own attempt, is the one being reported).
WITH moved AS (
    UPDATE outbox_operations SET {writes}
    WHERE id = %(operation_id)s AND status = 'dispatching' AND fencing_token = %(token)s
      AND NOT EXISTS (SELECT 1 FROM outbox_attempts a WHERE a.operation_id = outbox_operations.id AND a.id <> %(attempt_id)s
                      AND (a.attempt_class = 'succeeded'
                           OR (a.kind = 'dispatch' AND a.attempt_number > outbox_operations.proven_absent_through
                               AND a.attempt_class IN ('ambiguous', 'pending'))))
    RETURNING id, fencing_token
), att AS (
    UPDATE outbox_attempts SET ended_at = clock_timestamp(), attempt_class = %(klass)s, status_code = %(status_code)s,
        request_digest = %(request_digest)s, provider_request_id = %(provider_request_id)s,
        provider_reference = %(provider_reference)s, response_digest = %(response_digest)s,
        retry_after_s = %(retry_after_s)s, latency_s = %(latency_s)s, error = %(error)s, stale = %(stale)s,
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('outbox_operation_events_id_seq'), CAST(%(to)s AS varchar), CAST(%(event_reason)s AS text) FROM moved)
    WHERE id = %(attempt_id)s AND ended_at IS NULL
    RETURNING id
), logged AS (
    INSERT INTO outbox_operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), 'dispatching', %(to)s, fencing_token, %(event)s, %(event_reason)s, %(actor)s
    FROM moved WHERE NOT EXISTS (SELECT 1 FROM att)
)
SELECT (SELECT count(*) FROM att) AS wrote, (SELECT count(*) FROM moved) AS moved


-- name: settle
-- A reconciler's settlement: the operation it claimed in {source} moved to %(to)s, its lookup
-- attempt's report. A lookup claimed before migration 0015 has no claimed_from: its move's "from"
-- is the source.
WITH moved AS (
    UPDATE outbox_operations SET {writes}
    WHERE id = %(operation_id)s AND status = '{source}' AND fencing_token = %(token)s
    RETURNING id, fencing_token
), att AS (
    UPDATE outbox_attempts SET ended_at = clock_timestamp(), attempt_class = %(klass)s, status_code = %(status_code)s,
        request_digest = %(request_digest)s, provider_request_id = %(provider_request_id)s,
        provider_reference = %(provider_reference)s, response_digest = %(response_digest)s,
        retry_after_s = %(retry_after_s)s, latency_s = %(latency_s)s, error = %(error)s, stale = %(stale)s,
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('outbox_operation_events_id_seq'), CAST(%(to)s AS varchar), CAST(%(event_reason)s AS text) FROM moved),
        claimed_from = coalesce(claimed_from, '{source}')
    WHERE id = %(attempt_id)s AND ended_at IS NULL
    RETURNING id
), logged AS (
    INSERT INTO outbox_operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), '{source}', %(to)s, fencing_token, %(event)s, %(event_reason)s, %(actor)s
    FROM moved WHERE NOT EXISTS (SELECT 1 FROM att)
)
SELECT (SELECT count(*) FROM att) AS wrote, (SELECT count(*) FROM moved) AS moved


-- name: finalize_rows
-- finalize for many operations moved to the same status in ONE statement: %(rows)s is a JSON array
-- with one object per operation (pg_moves.FINALIZE_COLUMNS by name), the statement answers one row
-- (wrote, moved) per operation in their order. The same writes, fence and event rows as that many
-- finalize statements: PostgreSQL's cost per statement (executor start, a CTE plan of three
-- writes) is paid once per doorbell instead of once per operation. One JSON text, not an array per
-- parameter: psycopg dumps arrays element by element in Python (~60 us per operation of worker CPU
-- for these, measured), the json module in C (~4 us).
-- No guard: a move that claims "no effect" reads every other attempt of its own operation, and goes
-- alone (finalize_if_no_effect). The operations must be distinct (one row of v per operation).
-- v's columns are the parameters' names after "p_": none is a column of the tables it updates (so
-- no name in the statement can mean either), and none a keyword ("to").
-- %(ids)s and %(attempt_ids)s: the operations' and attempt rows' ids again, as arrays: PostgreSQL
-- cannot see into the JSON when it plans (it counts 100 rows), and without them it scanned every
-- row in dispatching (and their dead index entries) for the ten it moves, and every attempt row
-- while the table is small enough for a scan to look cheaper than 100 index probes (below ~30,000
-- rows: 1.7 ms per statement at 20,000).
WITH v AS (
    SELECT * FROM ROWS FROM (json_to_recordset(CAST(%(rows)s AS json))
        AS ("operation_id" text, "token" bigint, "attempt_id" bigint, "to" text, "reason" text,
            "event_reason" text, "event" text, "actor" text, "waiting_for" text, "delay_s" float8,
            "result" text, "klass" text, "status_code" integer, "request_digest" text,
            "provider_request_id" text, "provider_reference" text, "response_digest" text,
            "retry_after_s" float8, "latency_s" float8, "error" text, "stale" boolean, "sent_version" text,
            "sent_method" text, "sent_path" text, "sent_body" text, "sent_digest" text, "sent_key_header" text))
        WITH ORDINALITY
        AS v(p_operation_id, p_token, p_attempt_id, p_to, p_reason, p_event_reason, p_event, p_actor,
             p_waiting_for, p_delay_s, p_result, p_klass, p_status_code, p_request_digest, p_provider_request_id,
             p_provider_reference, p_response_digest, p_retry_after_s, p_latency_s, p_error, p_stale,
             p_sent_version, p_sent_method, p_sent_path, p_sent_body, p_sent_digest, p_sent_key_header, ord)
), moved AS (
    UPDATE outbox_operations SET {writes}
    FROM v
    WHERE outbox_operations.id = v.p_operation_id AND outbox_operations.id = ANY(CAST(%(ids)s AS text[]))
      AND status = 'dispatching' AND fencing_token = v.p_token
    RETURNING outbox_operations.id, outbox_operations.fencing_token
), att AS (
    UPDATE outbox_attempts SET ended_at = clock_timestamp(), attempt_class = v.p_klass, status_code = v.p_status_code,
        request_digest = v.p_request_digest, provider_request_id = v.p_provider_request_id,
        provider_reference = v.p_provider_reference, response_digest = v.p_response_digest,
        retry_after_s = v.p_retry_after_s, latency_s = v.p_latency_s, error = v.p_error, stale = v.p_stale,
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('outbox_operation_events_id_seq'), CAST(v.p_to AS varchar), v.p_event_reason
             FROM moved WHERE moved.id = v.p_operation_id)
    FROM v
    WHERE outbox_attempts.id = v.p_attempt_id AND outbox_attempts.id = ANY(CAST(%(attempt_ids)s AS bigint[]))
      AND ended_at IS NULL
    RETURNING outbox_attempts.id
), logged AS (
    INSERT INTO outbox_operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT moved.id, clock_timestamp(), 'dispatching', v.p_to, moved.fencing_token, v.p_event, v.p_event_reason, v.p_actor
    FROM moved JOIN v ON v.p_operation_id = moved.id
    WHERE NOT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id)
)
SELECT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id) AS wrote,
    EXISTS (SELECT 1 FROM moved WHERE moved.id = v.p_operation_id) AS moved
FROM v ORDER BY v.ord


-- name: settle_rows
-- settle for many operations claimed in {source} and moved to the same status, in ONE statement
-- (finalize_rows says how and why).
WITH v AS (
    SELECT * FROM ROWS FROM (json_to_recordset(CAST(%(rows)s AS json))
        AS ("operation_id" text, "token" bigint, "attempt_id" bigint, "to" text, "reason" text,
            "event_reason" text, "event" text, "actor" text, "waiting_for" text, "delay_s" float8,
            "result" text, "klass" text, "status_code" integer, "request_digest" text,
            "provider_request_id" text, "provider_reference" text, "response_digest" text,
            "retry_after_s" float8, "latency_s" float8, "error" text, "stale" boolean, "sent_version" text,
            "sent_method" text, "sent_path" text, "sent_body" text, "sent_digest" text, "sent_key_header" text))
        WITH ORDINALITY
        AS v(p_operation_id, p_token, p_attempt_id, p_to, p_reason, p_event_reason, p_event, p_actor,
             p_waiting_for, p_delay_s, p_result, p_klass, p_status_code, p_request_digest, p_provider_request_id,
             p_provider_reference, p_response_digest, p_retry_after_s, p_latency_s, p_error, p_stale,
             p_sent_version, p_sent_method, p_sent_path, p_sent_body, p_sent_digest, p_sent_key_header, ord)
), moved AS (
    UPDATE outbox_operations SET {writes}
    FROM v
    WHERE outbox_operations.id = v.p_operation_id AND outbox_operations.id = ANY(CAST(%(ids)s AS text[]))
      AND status = '{source}' AND fencing_token = v.p_token
    RETURNING outbox_operations.id, outbox_operations.fencing_token
), att AS (
    UPDATE outbox_attempts SET ended_at = clock_timestamp(), attempt_class = v.p_klass, status_code = v.p_status_code,
        request_digest = v.p_request_digest, provider_request_id = v.p_provider_request_id,
        provider_reference = v.p_provider_reference, response_digest = v.p_response_digest,
        retry_after_s = v.p_retry_after_s, latency_s = v.p_latency_s, error = v.p_error, stale = v.p_stale,
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('outbox_operation_events_id_seq'), CAST(v.p_to AS varchar), v.p_event_reason
             FROM moved WHERE moved.id = v.p_operation_id),
        claimed_from = coalesce(claimed_from, '{source}')
    FROM v
    WHERE outbox_attempts.id = v.p_attempt_id AND outbox_attempts.id = ANY(CAST(%(attempt_ids)s AS bigint[]))
      AND ended_at IS NULL
    RETURNING outbox_attempts.id
), logged AS (
    INSERT INTO outbox_operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT moved.id, clock_timestamp(), '{source}', v.p_to, moved.fencing_token, v.p_event, v.p_event_reason, v.p_actor
    FROM moved JOIN v ON v.p_operation_id = moved.id
    WHERE NOT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id)
)
SELECT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id) AS wrote,
    EXISTS (SELECT 1 FROM moved WHERE moved.id = v.p_operation_id) AS moved
FROM v ORDER BY v.ord


-- name: current_row
-- Why a move was refused: the operation's status and fencing token now.
SELECT status, fencing_token FROM outbox_operations WHERE id = %(id)s


-- name: mark_attempt_stale
-- An attempt row written by a worker whose move was refused (its lease taken over): kept, marked stale.
UPDATE outbox_attempts SET stale = true WHERE id = %(id)s
