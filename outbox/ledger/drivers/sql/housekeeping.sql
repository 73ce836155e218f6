-- Housekeeping: planner statistics, plan settings, timeouts and the migration lock. Read by
-- outbox/ledger/drivers/pg_statements.py; the file format is claim.sql's.
--
-- Placeholder, filled in by Python before the text is sent:
--   {ms}  a statement timeout in milliseconds (an integer).


-- name: stale_statistics
-- Queue tables changed enough since their last ANALYZE (outbox/ledger/planner_stats.py): by
-- n_mod_since_analyze, or since the caller's mark (the table's changes when the caller last
-- analyzed it) where that is fewer: an ANALYZE of some columns leaves n_mod_since_analyze as it
-- was. "searched": the columns an index keys or filters on (words of a partial index's predicate).
SELECT s.relname, c.changes,
       (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_attribute AS a
        WHERE a.attrelid = s.relid AND a.attnum > 0 AND NOT a.attisdropped AND EXISTS (
            SELECT FROM pg_index AS i WHERE i.indrelid = s.relid AND (a.attnum = ANY(i.indkey)
                OR pg_get_expr(i.indpred, i.indrelid) ~ ('\m' || a.attname || '\M')))) AS searched
FROM pg_stat_user_tables AS s
CROSS JOIN LATERAL (SELECT s.n_tup_ins + s.n_tup_upd + s.n_tup_del AS changes) AS c
LEFT JOIN unnest(CAST(%(tables)s AS text[]), CAST(%(marks)s AS bigint[])) AS m(relname, mark) USING (relname)
WHERE s.relname = ANY(%(tables)s) AND s.schemaname = current_schema()
  AND LEAST(s.n_mod_since_analyze, CASE WHEN m.mark <= c.changes THEN c.changes - m.mark END)
      >= GREATEST(%(min_rows)s, %(share)s * s.n_live_tup)


-- name: statement_timeout
-- A timeout for the rest of the caller's transaction.
SET LOCAL statement_timeout = {ms}


-- name: generic_plans
-- Before a hot-path statement: its cached generic plan, never a custom one (postgres.py
-- _generic_rows says why), keeping the setting the transaction had. Transaction-scoped, never a
-- session-wide SET: behind a transaction-pooling PgBouncer that would stay on the server
-- connection and reach other clients. set_config, not SET LOCAL: on the worker's autocommit
-- connection the pipeline is an implicit transaction, where SET LOCAL works but warns (a log line
-- per claim).
SELECT set_config('plan_cache_mode', 'force_generic_plan', true)
FROM (SELECT set_config('agent_outbox.plan_cache_mode', current_setting('plan_cache_mode'), true)) AS kept


-- name: plans_as_before
-- After a hot-path statement: the plan setting the transaction had (generic_plans kept it).
SELECT set_config('plan_cache_mode', current_setting('agent_outbox.plan_cache_mode'), true)


-- name: migration_lock
-- Two `migrate` runs at once (compose restarts, replicas) must not race: a transaction-scoped
-- advisory lock, its key 7243011.
SELECT pg_advisory_xact_lock(7243011)
