-- Evidence: the attempt log a record is built from, and the evidence rows. Read by
-- outbox/ledger/drivers/pg_statements.py; the file format is claim.sql's.
--
-- Placeholder, filled in by Python before the text is sent:
--   {columns}  the attempt columns the caller reads (names of outbox_attempts' columns).


-- name: attempt_log
-- The attempt rows of the operations %(ids)s, in the order they were opened.
SELECT {columns} FROM outbox_attempts WHERE operation_id = ANY(%(ids)s) ORDER BY id


-- name: insert_evidence
-- One evidence record (on a caller's transaction on another driver: one per record).
INSERT INTO outbox_evidence (operation_id, tenant, idempotency_key, action, args_digest, provider_reference,
                      response_digest, attempt_log_digest, recorded_at)
VALUES (%(operation_id)s, %(tenant)s, %(idempotency_key)s, %(action)s, %(args_digest)s, %(provider_reference)s,
        %(response_digest)s, %(attempt_log_digest)s, clock_timestamp())


-- name: insert_evidence_rows
-- A doorbell's evidence in one statement (one executor start, not one per record): %(rows)s is a
-- JSON array of records (pg_statements.EVIDENCE_COLUMNS).
INSERT INTO outbox_evidence (operation_id, tenant, idempotency_key, action, args_digest, provider_reference,
                             response_digest, attempt_log_digest, recorded_at)
SELECT *, clock_timestamp()
FROM json_to_recordset(CAST(%(rows)s AS json)) AS r(operation_id text, tenant text, idempotency_key text, action text,
    args_digest text, provider_reference text, response_digest text, attempt_log_digest text)
