-- Submit: an intent's operation row, written in the caller's own transaction. Read by
-- outbox/ledger/drivers/pg_statements.py; the file format is claim.sql's.
--
-- The row and the NOTIFY in ONE statement (one round trip). The row records its own submit event
-- (its id from the events' sequence, the status entered, the reason: outbox_history shows it as
-- the event row it stands for). The notification comes only from a row this statement inserted
-- (ON CONFLICT DO NOTHING inserts none for a replay); it is delivered when the caller commits, on
-- the channel the relay LISTENs on (outbox_due, payload: the operation's id).
-- A submit answers one row when it inserted (the row's times: a submit is answered from them),
-- none for a replay.


-- name: submit_notify
-- Submit an operation that is due (not_dispatched): the relay hears of it on commit.
WITH ins AS (
    INSERT INTO outbox_operations (id, tenant, idempotency_key, provider_key, action, args, args_digest, subject, run_id,
        tool_call_id, status, waiting_for, reason, fencing_token, attempt_count, max_attempts, deadline_at,
        next_attempt_at, cancel_requested, proven_absent_through, created_at, updated_at, submitted_by, key_space,
        priority, traceparent, object_key, budget_scope, submit_event_id, submitted_as, submit_reason,
        action_version)
    VALUES (%(id)s, %(tenant)s, %(key)s, %(provider_key)s, %(action)s, %(args)s, %(digest)s, %(subject)s, %(run_id)s,
        %(tool_call_id)s, %(status)s, %(waiting_for)s, 'submitted', 0, 0, %(max_attempts)s,
        clock_timestamp() + make_interval(secs => CAST(%(deadline_s)s AS float8)),  -- NULL: no deadline
        clock_timestamp() + make_interval(secs => CAST(%(delay_s)s AS float8)),
        false, 0, clock_timestamp(), clock_timestamp(), %(submitted_by)s, %(key_space)s, %(priority)s,
        %(traceparent)s, %(object_key)s, %(budget_scope)s, nextval('outbox_operation_events_id_seq'), %(status)s, %(reason)s,
        %(action_version)s)
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id, created_at, updated_at, next_attempt_at, deadline_at
)
SELECT created_at, updated_at, next_attempt_at, deadline_at, pg_notify('outbox_due', id) AS notified FROM ins


-- name: submit_quiet
-- Submit an operation that is not due (awaiting_approval): no notification.
WITH ins AS (
    INSERT INTO outbox_operations (id, tenant, idempotency_key, provider_key, action, args, args_digest, subject, run_id,
        tool_call_id, status, waiting_for, reason, fencing_token, attempt_count, max_attempts, deadline_at,
        next_attempt_at, cancel_requested, proven_absent_through, created_at, updated_at, submitted_by, key_space,
        priority, traceparent, object_key, budget_scope, submit_event_id, submitted_as, submit_reason,
        action_version)
    VALUES (%(id)s, %(tenant)s, %(key)s, %(provider_key)s, %(action)s, %(args)s, %(digest)s, %(subject)s, %(run_id)s,
        %(tool_call_id)s, %(status)s, %(waiting_for)s, 'submitted', 0, 0, %(max_attempts)s,
        clock_timestamp() + make_interval(secs => CAST(%(deadline_s)s AS float8)),  -- NULL: no deadline
        clock_timestamp() + make_interval(secs => CAST(%(delay_s)s AS float8)),
        false, 0, clock_timestamp(), clock_timestamp(), %(submitted_by)s, %(key_space)s, %(priority)s,
        %(traceparent)s, %(object_key)s, %(budget_scope)s, nextval('outbox_operation_events_id_seq'), %(status)s, %(reason)s,
        %(action_version)s)
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id, created_at, updated_at, next_attempt_at, deadline_at
)
SELECT created_at, updated_at, next_attempt_at, deadline_at FROM ins


-- name: notify_due
-- An operation made due by something other than a submit (an approval): the relay hears it on commit.
SELECT pg_notify('outbox_due', %(id)s)
