-- Housekeeping: planner statistics, plan settings, timeouts and the migration lock. Read by
-- outbox/ledger/drivers/pg_statements.py; the file format is claim.sql's.
--
-- Placeholder, filled in by Python before the text is sent:
--   {ms}  a statement timeout in milliseconds (an integer).


-- name: stale_statistics
-- The queue tables (outbox/ledger/planner_stats.py), each with "stale": changed enough since its last
-- ANALYZE, by n_mod_since_analyze, or since the caller's mark (the table's changes when the caller
-- last analyzed it) where that is fewer (an ANALYZE of some columns leaves n_mod_since_analyze as it
-- was); or young (fewer than %(young_rows)s rows when last analyzed, -1 if never) and grown to twice
-- that since, and to %(young_first)s rows at least. "young": whether it is young once analyzed if
-- stale (by its live rows now), else as it is. "searched", for a stale table: the columns an index
-- keys or filters on (words of a partial index's predicate).
SELECT t.relname, t.changes, t.stale,
       CASE WHEN t.stale THEN t.live < %(young_rows)s ELSE t.analyzed < %(young_rows)s END AS young,
       CASE WHEN t.stale THEN (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_attribute AS a
        WHERE a.attrelid = t.relid AND a.attnum > 0 AND NOT a.attisdropped AND EXISTS (
            SELECT FROM pg_index AS i WHERE i.indrelid = t.relid AND (a.attnum = ANY(i.indkey)
                OR pg_get_expr(i.indpred, i.indrelid) ~ ('\m' || a.attname || '\M')))) END AS searched
FROM (
    SELECT s.relname, s.relid, c.changes, s.n_live_tup AS live, k.reltuples AS analyzed,
        LEAST(s.n_mod_since_analyze, CASE WHEN m.mark <= c.changes THEN c.changes - m.mark END)
            >= GREATEST(%(min_rows)s, %(share)s * s.n_live_tup)
        OR (k.reltuples < %(young_rows)s AND s.n_live_tup >= GREATEST(%(young_first)s, 2 * k.reltuples)) AS stale
    FROM pg_stat_user_tables AS s
    JOIN pg_class AS k ON k.oid = s.relid
    CROSS JOIN LATERAL (SELECT s.n_tup_ins + s.n_tup_upd + s.n_tup_del AS changes) AS c
    LEFT JOIN unnest(CAST(%(tables)s AS text[]), CAST(%(marks)s AS bigint[])) AS m(relname, mark) ON m.relname = s.relname
    WHERE s.relname = ANY(%(tables)s) AND s.schemaname = current_schema()
) AS t


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
-- And a random page read priced at 1.1 sequential ones (or the server's price, where lower): the
-- hot path reads the queue's recent rows, which are in memory. PostgreSQL's default (4) prices a
-- probe as a disk seek: ten probes of the primary key looked dearer than reading a table of a few
-- hundred rows whole, and the generic plan made while a new ledger's table was that small (the
-- first claims) kept the whole-table read while it grew: a claim's update read every operation row
-- (0.5 ms at 1,000 rows) and a finalize every attempt row until the relay's first ANALYZE made
-- them re-plan. At 1.1 the probes win from ~100 rows. A generic plan is made with
-- the settings of the execution that makes it, so these hold for it as long as it lives. The price
-- is kept as text (numeric, not float: exact whatever extra_float_digits says). A tablespace's own
-- random_page_cost, where set, takes precedence over this (docs/how-to/deploy.md).
SELECT set_config('plan_cache_mode', 'force_generic_plan', true),
       set_config('random_page_cost', CASE
           WHEN CAST(current_setting('random_page_cost') AS numeric) < 1.1 * CAST(current_setting('seq_page_cost') AS numeric)
           THEN current_setting('random_page_cost')
           ELSE CAST(1.1 * CAST(current_setting('seq_page_cost') AS numeric) AS text) END, true)
FROM (SELECT set_config('agent_outbox.plan_cache_mode', current_setting('plan_cache_mode'), true),
             set_config('agent_outbox.random_page_cost', current_setting('random_page_cost'), true)) AS kept


-- name: plans_as_before
-- After a hot-path statement: the plan settings the transaction had (generic_plans kept them).
SELECT set_config('plan_cache_mode', current_setting('agent_outbox.plan_cache_mode'), true),
       set_config('random_page_cost', current_setting('agent_outbox.random_page_cost'), true)


-- name: migration_lock
-- Two `migrate` runs at once (compose restarts, replicas) must not race: a transaction-scoped
-- advisory lock, its key 7243011.
SELECT pg_advisory_xact_lock(7243011)
