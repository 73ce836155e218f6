"""The PostgreSQL driver's statements: every SQL text the ledger sends to PostgreSQL, by name.

Plain SQL sent through psycopg (``%(name)s`` parameters), not SQLAlchemy constructs: on the hot
path SQLAlchemy's per-execute work cost more client CPU than PostgreSQL spent running the
statements. Statements that come in shapes (a claim with or without ids, a
finalize per target status) are built from named parts, once per shape (``lru_cache``): here, and
the fenced moves' in pg_moves.py (the tenant walk's parts: pg_tenant_walk.py).

Written for psycopg 3 (``%(name)s``), the hot path's driver; ``named`` gives any statement in
SQLAlchemy's ``:name`` form, for a caller's transaction on another driver (psycopg2, asyncpg,
psycopg's async connection: outbox/ledger/drivers/postgres.py). So a cast next to a parameter is
written ``CAST(... AS type)``, never ``%(name)s::type``, which SQLAlchemy would not read as a
parameter; asyncpg types every parameter from its context, and the casts keep those types the
ones psycopg sends.

Status values and LIMITs are written in as literals, not parameters: psycopg prepares a statement
after a few executions, and only then can PostgreSQL keep one generic plan for it. With the status
as a parameter the generic plan cannot use the partial index of that status, and with LIMIT as a
parameter it is costed for 10% of the table, so PostgreSQL re-planned every claim: planning cost
as much as running it.
"""

from __future__ import annotations

import functools
import re

from outbox.ledger import request_record
from outbox.ledger.drivers.pg_tenant_walk import (
    CLAIM_ORDER,
    FAIR_DUE,
    FAIR_RANKING,
    FAIR_TENANTS,
    FAIR_WALK,
    IDS_IN,
    IDS_NOT_IN,
    LEASE_FREE,
    NOT_DISPATCHED,
    UNFAIR_RANKING,
    WEIGHTED,
)
from outbox.ledger.effect_guard import may_have_taken_effect
from outbox.ledger.models import ATTEMPTS, EVIDENCE, OPERATION_EVENTS, OPERATIONS, RECONCILE_DUE
from outbox.ledger.request_record import left_versions_sql
from outbox.ledger.states import AttemptKind, Status

# The events' id sequence (PostgreSQL names a serial column's after its table): events recorded on
# attempt rows draw their ids from it, so the history keeps the order it was written in.
EVENTS_ID_SEQ = f"{OPERATION_EVENTS}_id_seq"
NOTIFY_CHANNEL = "outbox_due"  # the relay LISTENs here; payload = operation id
# pg_try_advisory_lock key held by the relay that rings doorbells straight from NOTIFY ("relay").
NOTIFY_LEADER_LOCK = 0x72656C6179
# pg_advisory_xact_lock key: two `migrate` runs at once (compose restarts, replicas) must not race.
MIGRATION_LOCK = 7243011


def driver_params(sql: str) -> str:
    """SQL written with ``:name`` parameters, as psycopg wants them (``%(name)s``); ``::`` casts stay."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql)


@functools.lru_cache(maxsize=128)
def named(statement: str) -> str:
    """A catalogue statement with SQLAlchemy's ``:name`` parameters (``text()``) instead of psycopg's."""
    if re.search(r"%\(\w+\)s::", statement):
        raise ValueError("a parameter cast as %(name)s::type: write CAST(%(name)s AS type)")
    return re.sub(r"%\((\w+)\)s", r":\1", statement)


# -- submit ---------------------------------------------------------------------------------------
# The intent row and the NOTIFY in ONE statement (one round trip). The row records its own submit
# event (its id from the events' sequence, the status entered, the reason: outbox_history shows it
# as the event row it stands for). The notification comes only from a row this statement inserted
# (ON CONFLICT DO NOTHING inserts none for a replay); it is delivered when the caller commits.
_SUBMIT = f"""
WITH ins AS (
    INSERT INTO {OPERATIONS} (id, tenant, idempotency_key, provider_key, action, args, args_digest, subject, run_id,
        tool_call_id, status, waiting_for, reason, fencing_token, attempt_count, max_attempts, deadline_at,
        next_attempt_at, cancel_requested, proven_absent_through, created_at, updated_at, submitted_by, key_space,
        priority, traceparent, object_key, budget_scope, submit_event_id, submitted_as, submit_reason,
        action_version)
    VALUES (%(id)s, %(tenant)s, %(key)s, %(provider_key)s, %(action)s, %(args)s, %(digest)s, %(subject)s, %(run_id)s,
        %(tool_call_id)s, %(status)s, %(waiting_for)s, 'submitted', 0, 0, %(max_attempts)s,
        clock_timestamp() + make_interval(secs => CAST(%(deadline_s)s AS float8)),  -- NULL: no deadline
        clock_timestamp() + make_interval(secs => CAST(%(delay_s)s AS float8)),
        false, 0, clock_timestamp(), clock_timestamp(), %(submitted_by)s, %(key_space)s, %(priority)s,
        %(traceparent)s, %(object_key)s, %(budget_scope)s, nextval('{EVENTS_ID_SEQ}'), %(status)s, %(reason)s,
        %(action_version)s)
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id, created_at, updated_at, next_attempt_at, deadline_at
)
SELECT created_at, updated_at, next_attempt_at, deadline_at"""
# The submit's parameters that are NewOperation's fields as they are (key, digest, status, waiting_for: spelled).
SUBMIT_AS_GIVEN: tuple[str, ...] = (
    "id",
    "tenant",
    "provider_key",
    "action",
    "args",
    "subject",
    "run_id",
    "tool_call_id",
)
SUBMIT_AS_GIVEN += ("max_attempts", "deadline_s", "delay_s", "reason", "submitted_by", "key_space", "priority")
SUBMIT_AS_GIVEN += ("traceparent", "object_key", "budget_scope", "action_version")
# One row when inserted (the row's times: a submit is answered from them), none for a replay.
SUBMIT_NOTIFY = _SUBMIT + f", pg_notify('{NOTIFY_CHANNEL}', id) AS notified FROM ins"
SUBMIT_QUIET = _SUBMIT + " FROM ins"
# An operation made due by something other than a submit (an approval): the relay hears it on commit.
NOTIFY_DUE = f"SELECT pg_notify('{NOTIFY_CHANNEL}', %(id)s)"


# -- claims ---------------------------------------------------------------------------------------
# The whole claim in ONE statement: lock due rows with SKIP LOCKED, bump token and lease, number the
# attempt, open the attempt row, which records the claim's event too (its id from the events'
# sequence, the status claimed from: outbox_history shows it as the event row it stands for). The
# CTEs read attempts as of the statement's snapshot, so numbering and the ambiguity check see the
# rows committed before this claim.
# A dispatch claim's attempt row records the version of its action the worker holds (:versions, a
# JSON object action -> version: one parameter for the batch), and the claim answers, when nothing
# is on record, the versions of the earlier attempts that may have left (request_record.py).
_CLAIM = """
WITH {recursive}{due_ctes}, claimed AS (
    UPDATE {operations} o SET
        fencing_token = o.fencing_token + 1,
        lease_owner = :worker,
        lease_expires_at = clock_timestamp() + make_interval(secs => :lease_s),
        updated_at = clock_timestamp(){dispatch_sets}
    FROM due WHERE o.id = due.id
    RETURNING due.rank, o.id, o.fencing_token, o.attempt_count, o.tenant, o.idempotency_key, o.provider_key, o.action,
              o.args,
              o.args_digest, o.subject, o.lease_expires_at, o.max_attempts, o.deadline_at, o.created_at,
              o.cancel_requested, o.proven_absent_through, o.updated_at, o.status, o.traceparent,
              o.action_version, o.request_version, o.request_method, o.request_path, o.request_body, o.request_digest,
              o.request_key_header, o.submitted_by, o.budget_scope
), numbered AS (
    SELECT c.*,
        (SELECT coalesce(max(a.attempt_number), 0) + 1 FROM {attempts} a
          WHERE a.operation_id = c.id AND a.kind = '{kind}') AS number,
        EXISTS (SELECT 1 FROM {attempts} a WHERE a.operation_id = c.id AND {may_have_taken_effect}) AS open_ambiguity,
        {left_versions} AS left_versions
    FROM claimed c
), opened AS (
    INSERT INTO {attempts} (operation_id, attempt_number, kind, fencing_token, worker, started_at, attempt_class, stale,
        claim_event_id, claimed_from, action_version)
    SELECT id, number, '{kind}', fencing_token, :worker, clock_timestamp(), 'pending', false,
        nextval('{events_id_seq}'), {from_status}, {claimed_under}
    FROM numbered
    RETURNING id AS attempt_id, operation_id
)
SELECT n.*, o.attempt_id FROM numbered n JOIN opened o ON o.operation_id = n.id ORDER BY n.rank
"""

# Due rows of one kind in claim order (priority first; lookups oldest first); {ids} narrows or
# excludes, {limit} is a literal.
_DUE = """
    SELECT id, {rank} AS rank FROM {operations}
    WHERE {source} AND next_attempt_at <= {now}{lease_free}{ids}
    ORDER BY {order}
    LIMIT {limit}
    FOR UPDATE SKIP LOCKED"""


@functools.lru_cache(maxsize=64)
def claim(kind: AttemptKind, with_ids: bool, limit: int, others: int, fair: bool = False, ids_fit: bool = False) -> str:
    """The claim statement for one shape: ``limit`` of the given ids, then ``others`` due rows.

    A dispatch claim of due rows walks the tenants (above), with parameters :after_tenant (the
    cursor, '' at first), :weight_tenants and :weights (tenants weighted other than 1). ``fair``:
    shared among them, the given ids first only within their own tenant; else the given ids
    first, then priority and age. Given ids alone, and lookups, are claimed as they are.

    ``ids_fit``: no more ids are given than ``limit`` (a doorbell's batch), so they bound their own
    rows and the walk writes their LIMIT as the batch's size: every split of one batch size between
    given ids and at least one other row is then one text, which psycopg prepares once per connection and
    PostgreSQL plans once, instead of one per split, each planned afresh until its own fifth run
    (a claim's planning cost about what running it did).
    """
    lookup = kind is AttemptKind.LOOKUP
    # A lookup claim keeps its row's status (outcome_unknown or accepted): its attempt's claimed_from says which.
    source = RECONCILE_DUE if lookup else NOT_DISPATCHED

    def due(rank: int, ids: str, n: int) -> str:
        # Given ids: found through the primary key, the due bound only filters (clock_timestamp()).
        # Any due rows: the bound must be one the due index can answer (statement_timestamp(), see
        # outbox/ledger/clock.py db_scan_now), else each claim reads the index's every dead entry.
        now = "clock_timestamp()" if ids == IDS_IN else "statement_timestamp()"
        return _DUE.format(
            rank=rank,
            source=source,
            now=now,
            lease_free=LEASE_FREE if lookup else "",
            ids=ids,
            order="next_attempt_at" if lookup else CLAIM_ORDER,
            limit=n,
            operations=OPERATIONS,
        )

    recursive = ""
    if not lookup and (others or not with_ids):
        recursive = "RECURSIVE "
        take = int(limit) + int(others) if with_ids else int(limit)
        ctes = (
            FAIR_WALK.format(operations=OPERATIONS, tenants=FAIR_TENANTS)
            + ","
            + WEIGHTED
            + ", "
            + FAIR_DUE.format(
                operations=OPERATIONS,
                wanted=(take if ids_fit else int(limit)) if with_ids else 0,
                take=take,
                not_wanted=IDS_NOT_IN if with_ids else "",
                ranking=FAIR_RANKING if fair else UNFAIR_RANKING,
            )
        )
        if not with_ids:  # no doorbell ids: the wanted CTE finds none (an empty array)
            ctes = ctes.replace(IDS_IN, " AND false")
    elif not with_ids:
        ctes = f"due AS ({due(1, '', int(limit))}\n)"
    else:
        ctes = f"wanted AS ({due(0, IDS_IN, int(limit))}\n)"
        if others:
            ctes += (
                f", others AS ({due(1, IDS_NOT_IN, int(others))}\n)"
                ", due AS (SELECT id, rank FROM wanted UNION ALL SELECT id, rank FROM others)"
            )
        else:
            ctes += ", due AS (SELECT id, rank FROM wanted)"
    dispatch_sets = (
        ""
        if lookup
        else f",\n        status = '{Status.DISPATCHING.value}', attempt_count = o.attempt_count + 1, reason = 'claimed',"
        " waiting_for = NULL"
    )
    return driver_params(
        _CLAIM.format(
            recursive=recursive,
            due_ctes=ctes,
            kind=kind.value,
            from_status="status" if lookup else f"'{Status.NOT_DISPATCHED.value}'",
            may_have_taken_effect=may_have_taken_effect("c"),
            left_versions="CAST(NULL AS text)" if lookup else left_versions_sql("c", "string_agg(DISTINCT {}, ',')"),
            claimed_under="NULL" if lookup else "CAST(:versions AS json) ->> action",
            dispatch_sets=dispatch_sets,
            operations=OPERATIONS,
            attempts=ATTEMPTS,
            events_id_seq=EVENTS_ID_SEQ,
        )
    )


# -- finalize: pg_moves.py ------------------------------------------------------------------------
CURRENT_ROW = f"SELECT status, fencing_token FROM {OPERATIONS} WHERE id = %(id)s"
MARK_ATTEMPT_STALE = f"UPDATE {ATTEMPTS} SET stale = true WHERE id = %(id)s"
RECORD_IF_NONE = driver_params(request_record.RECORD_IF_NONE)

# A doorbell's first read: which of its ids are due now, with what a deadline check needs.
READ_DUE = f"""
SELECT id, action, created_at, deadline_at, max_attempts, attempt_count, clock_timestamp() AS db_now
FROM {OPERATIONS}
WHERE id = ANY(%(ids)s) AND status = '{Status.NOT_DISPATCHED.value}' AND next_attempt_at <= clock_timestamp()
"""


# -- evidence -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def attempt_log(columns: tuple[str, ...]) -> str:
    return f"SELECT {', '.join(columns)} FROM {ATTEMPTS} WHERE operation_id = ANY(%(ids)s) ORDER BY id"


INSERT_EVIDENCE = f"""
INSERT INTO {EVIDENCE} (operation_id, tenant, idempotency_key, action, args_digest, provider_reference,
                      response_digest, attempt_log_digest, recorded_at)
VALUES (%(operation_id)s, %(tenant)s, %(idempotency_key)s, %(action)s, %(args_digest)s, %(provider_reference)s,
        %(response_digest)s, %(attempt_log_digest)s, clock_timestamp())
"""
EVIDENCE_COLUMNS = (
    "operation_id",
    "tenant",
    "idempotency_key",
    "action",
    "args_digest",
    "provider_reference",
    "response_digest",
    "attempt_log_digest",
)
# A doorbell's evidence in one statement: %(rows)s is a JSON array of records (EVIDENCE_COLUMNS).
INSERT_EVIDENCE_ROWS = f"""
INSERT INTO {EVIDENCE} ({", ".join(EVIDENCE_COLUMNS)}, recorded_at)
SELECT *, clock_timestamp()
FROM json_to_recordset(CAST(%(rows)s AS json)) AS r({", ".join(f"{c} text" for c in EVIDENCE_COLUMNS)})
"""


# -- relay ----------------------------------------------------------------------------------------
MARK_RUNG = f"""
UPDATE {OPERATIONS} SET published_at = clock_timestamp()
WHERE id = ANY(%(ids)s) AND status = '{Status.NOT_DISPATCHED.value}' AND published_at IS NULL
"""


@functools.lru_cache(maxsize=4)
def mark_due(status: Status, leased_ok: bool, batch: int) -> str:
    """Mark up to ``batch`` due rows of ``status`` published (SKIP LOCKED: two relays never mark the
    same rows in the same window); returns (id, seconds since due).

    %(fresh_grace_s)s: never-published rows younger than this are left to the NOTIFY path, unless
    they were due before %(leading_since)s (NULL unless this relay leads the NOTIFY path).
    """
    lease = "" if leased_ok else "AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())"
    rung = f"""status = '{status.value}' AND next_attempt_at <= statement_timestamp()
      AND ((published_at IS NULL AND (next_attempt_at <= clock_timestamp() - make_interval(secs => %(fresh_grace_s)s)
                                      OR next_attempt_at < CAST(%(leading_since)s AS timestamptz)))
           OR published_at < next_attempt_at
           OR published_at < clock_timestamp() - make_interval(secs => %(republish_after_s)s))
      {lease}"""
    if status is not Status.NOT_DISPATCHED:
        due = f"""WITH due AS (
    SELECT id FROM {OPERATIONS}
    WHERE {rung}
    ORDER BY next_attempt_at
    LIMIT {int(batch)}
    FOR UPDATE SKIP LOCKED
)"""
    else:
        # Rung in the claim's order within each tenant (higher priority first), walking the tenants
        # as a claim does, from the first: the order by time alone would ring a tenant's old low
        # priorities first, and a doorbell's ids take their tenant's first turns in the claim.
        walk = FAIR_WALK.format(operations=OPERATIONS, tenants=FAIR_TENANTS).replace(
            "CAST(:after_tenant AS varchar)", "''"
        )
        due = f"""WITH RECURSIVE {walk}, due AS (
    SELECT d.id FROM walk t CROSS JOIN LATERAL (
        SELECT id, priority, next_attempt_at FROM {OPERATIONS}
        WHERE tenant = t.tenant AND {rung}
        ORDER BY {CLAIM_ORDER}
        LIMIT {int(batch)}
        FOR UPDATE SKIP LOCKED) d
    ORDER BY d.priority DESC, d.next_attempt_at
    LIMIT {int(batch)}
)"""
    return f"""
{due}
UPDATE {OPERATIONS} o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id
RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8
"""


LISTEN = f"LISTEN {NOTIFY_CHANNEL}"
# Session-level lock: released when the connection ends, so a standby takes over. The clock is
# read after LISTEN began: a row due later commits later, so it is notified.
TRY_LEAD = "SELECT pg_try_advisory_lock(%(key)s), clock_timestamp()"

# -- housekeeping ---------------------------------------------------------------------------------
# Queue tables changed enough since their last ANALYZE (outbox/ledger/planner_stats.py): by
# n_mod_since_analyze, or since the caller's mark (the table's changes when the caller last analyzed
# it) where that is fewer: an ANALYZE of some columns leaves n_mod_since_analyze as it was.
# ``searched``: the columns an index keys or filters on (words of a partial index's predicate).
STALE_STATISTICS = """
SELECT s.relname, c.changes,
       (SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum) FROM pg_attribute AS a
        WHERE a.attrelid = s.relid AND a.attnum > 0 AND NOT a.attisdropped AND EXISTS (
            SELECT FROM pg_index AS i WHERE i.indrelid = s.relid AND (a.attnum = ANY(i.indkey)
                OR pg_get_expr(i.indpred, i.indrelid) ~ ('\\m' || a.attname || '\\M')))) AS searched
FROM pg_stat_user_tables AS s
CROSS JOIN LATERAL (SELECT s.n_tup_ins + s.n_tup_upd + s.n_tup_del AS changes) AS c
LEFT JOIN unnest(CAST(%(tables)s AS text[]), CAST(%(marks)s AS bigint[])) AS m(relname, mark) USING (relname)
WHERE s.relname = ANY(%(tables)s) AND s.schemaname = current_schema()
  AND LEAST(s.n_mod_since_analyze, CASE WHEN m.mark <= c.changes THEN c.changes - m.mark END)
      >= GREATEST(%(min_rows)s, %(share)s * s.n_live_tup)
"""
STATEMENT_TIMEOUT = "SET LOCAL statement_timeout = %d"  # milliseconds, an int written in
# Around a hot-path statement: its cached generic plan, never a custom one (postgres.py
# _generic_rows says why), then the setting the transaction had. Transaction-scoped, never a
# session-wide SET: behind a transaction-pooling PgBouncer that would stay on the server connection
# and reach other clients. set_config, not SET LOCAL: on the worker's autocommit connection the
# pipeline is an implicit transaction, where SET LOCAL works but warns (a log line per claim).
GENERIC_PLANS = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', true)"
    " FROM (SELECT set_config('agent_outbox.plan_cache_mode', current_setting('plan_cache_mode'), true)) AS kept"
)
PLANS_AS_BEFORE = "SELECT set_config('plan_cache_mode', current_setting('agent_outbox.plan_cache_mode'), true)"
MIGRATION_LOCK_SQL = f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"
