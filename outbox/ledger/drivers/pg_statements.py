"""The PostgreSQL driver's statements: the SQL files in ``sql/`` by name, and which one runs.

The driver's own SQL is in ``outbox/ledger/drivers/sql/*.sql`` as named blocks (``-- name:
claim_dispatch_due``), each whole: a statement that comes in shapes (a claim with or without given
ids, fair or not; a relay's mark by tenant or by time) is one named query per shape, so the text a
DBA reads is the text that runs. ``QUERIES`` is that catalogue, read once at import; this module
picks the query for a shape and fills in its placeholders (``{limit}`` and the like: integers and
statuses written into the text, for the reason claim.sql's header gives; each file's header lists
its own). The fenced moves' choice is pg_moves.py's. Not here: a statement both drivers send
(request_record.py's ``RECORD_IF_NONE``) and those built with SQLAlchemy Core for both dialects.

Plain SQL sent through psycopg (``%(name)s`` parameters), not SQLAlchemy constructs: on the hot
path SQLAlchemy's per-execute work cost more client CPU than PostgreSQL spent running the
statements. ``named`` gives any statement in SQLAlchemy's ``:name`` form, for a caller's
transaction on another driver (psycopg2, asyncpg, psycopg's async connection:
outbox/ledger/drivers/postgres.py).

A few conditions are spelled in the SQL files and also in Python, for the SQLite driver and the
moves built with SQLAlchemy (the effect guard, the versions an attempt may have left under, the
reconciler's statuses, the attempt report): tests/unit/test_sql_files.py holds each pair to one text.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from outbox.ledger import request_record
from outbox.ledger.states import AttemptKind, Status

# A block: "-- name: <query_name>" on a line of its own, then the query (its comments included).
_NAME = re.compile(r"^-- name: (\w+)[ \t]*$", re.MULTILINE)
# A line that is only a comment: for the reader, not sent to the server.
_COMMENT_LINE = re.compile(r"^[ \t]*--.*(?:\n|$)", re.MULTILINE)
# A placeholder the driver fills in before sending: {limit}, {status}, ... (see each file's header).
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _load() -> dict[str, str]:
    """Every named query of the SQL files, its whole-line comments left out."""
    queries: dict[str, str] = {}
    for file in sorted(resources.files("outbox.ledger.drivers").joinpath("sql").iterdir(), key=lambda f: f.name):
        if not file.name.endswith(".sql"):
            continue
        _, *blocks = _NAME.split(file.read_text(encoding="utf-8"))
        for name, block in zip(blocks[::2], blocks[1::2]):
            if name in queries:
                raise ValueError(f"{file.name}: query {name!r} is named twice")
            queries[name] = _COMMENT_LINE.sub("", block).strip()
    return queries


QUERIES = _load()


def fill(query: str, **values: int | str) -> str:
    """A query with its placeholders filled in: every one it has, and only those. The values are
    ours (integers, statuses, the write sets of outbox/ledger/writes.py), never a caller's data."""
    wanted = set(_PLACEHOLDER.findall(query))
    if wanted != set(values):
        raise KeyError(f"placeholders {sorted(wanted)}, given {sorted(values)}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), query)


NOTIFY_CHANNEL = "outbox_due"  # the relay LISTENs here (relay.sql, submit.sql); payload = operation id
# pg_try_advisory_lock key held by the relay that rings doorbells straight from NOTIFY ("relay").
NOTIFY_LEADER_LOCK = 0x72656C6179


def driver_params(sql: str) -> str:
    """SQL written with ``:name`` parameters, as psycopg wants them (``%(name)s``); ``::`` casts stay."""
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql)


@functools.lru_cache(maxsize=128)
def named(statement: str) -> str:
    """A catalogue statement with SQLAlchemy's ``:name`` parameters (``text()``) instead of psycopg's."""
    if re.search(r"%\(\w+\)s::", statement):
        raise ValueError("a parameter cast as %(name)s::type: write CAST(%(name)s AS type)")
    return re.sub(r"%\((\w+)\)s", r":\1", statement)


# -- submit (submit.sql) ----------------------------------------------------------------------------
SUBMIT_NOTIFY = QUERIES["submit_notify"]
SUBMIT_QUIET = QUERIES["submit_quiet"]
NOTIFY_DUE = QUERIES["notify_due"]
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


# -- claims (claim.sql) -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def claim(kind: AttemptKind, with_ids: bool, limit: int, others: int, fair: bool = False, ids_fit: bool = False) -> str:
    """The claim statement for one shape: ``limit`` of the given ids, then ``others`` due rows.

    A dispatch claim of due rows walks the tenants (claim.sql), with parameters :after_tenant (the
    cursor, '' at first), :weight_tenants and :weights (tenants weighted other than 1). ``fair``:
    shared among them, the given ids first only within their own tenant; else the given ids
    first, then priority and age. Given ids alone, and lookups, are claimed as they are.

    ``ids_fit``: no more ids are given than ``limit`` (a doorbell's batch), so they bound their own
    rows and the walk writes their LIMIT as the batch's size: every split of one batch size between
    given ids and at least one other row is then one text, which psycopg prepares once per connection and
    PostgreSQL plans once, instead of one per split, each planned afresh until its own fifth run
    (a claim's planning cost about what running it did).
    """
    limit, others = int(limit), int(others)
    if kind is AttemptKind.LOOKUP:
        if not with_ids:
            return fill(QUERIES["claim_lookups_due"], limit=limit)
        if not others:
            return fill(QUERIES["claim_lookups_given"], limit=limit)
        return fill(QUERIES["claim_lookups_given_then_due"], limit=limit, others=others)
    if not with_ids:
        walk = QUERIES["claim_dispatch_due_fair"] if fair else QUERIES["claim_dispatch_due"]
        return fill(walk, limit=limit)
    if not others:
        return fill(QUERIES["claim_dispatch_given"], limit=limit)
    take = limit + others
    walk = QUERIES["claim_dispatch_given_then_due_fair"] if fair else QUERIES["claim_dispatch_given_then_due"]
    return fill(walk, wanted=take if ids_fit else limit, take=take)


READ_DUE = QUERIES["read_due"]

# -- fenced moves: pg_moves.py (moves.sql) ----------------------------------------------------------
CURRENT_ROW = QUERIES["current_row"]
MARK_ATTEMPT_STALE = QUERIES["mark_attempt_stale"]
# Shared with the SQLite driver: one spelling for both (outbox/ledger/request_record.py).
RECORD_IF_NONE = driver_params(request_record.RECORD_IF_NONE)


# -- evidence (evidence.sql) ------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def attempt_log(columns: tuple[str, ...]) -> str:
    if not all(c.isidentifier() for c in columns):
        raise ValueError(f"not column names: {columns}")
    return fill(QUERIES["attempt_log"], columns=", ".join(columns))


INSERT_EVIDENCE = QUERIES["insert_evidence"]
INSERT_EVIDENCE_ROWS = QUERIES["insert_evidence_rows"]
# The columns of insert_evidence_rows' JSON records, in its order.
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


# -- relay (relay.sql) ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def mark_due(status: Status, leased_ok: bool, batch: int, write: bool = True) -> str:
    """Mark up to ``batch`` due rows of ``status`` published; returns (id, seconds since due).

    not_dispatched rows are rung in the claim's order, walking the tenants; others by time.
    ``leased_ok``: rows under a live lease count too. ``write`` False: the same rows, read only
    (``_read_only``).
    """
    if status is Status.NOT_DISPATCHED:
        by_tenant = QUERIES["mark_due_by_tenant"] if leased_ok else QUERIES["mark_due_by_tenant_lease_free"]
        text, order = fill(by_tenant, batch=int(batch)), "o.priority DESC, o.next_attempt_at"
    else:
        by_time = QUERIES["mark_due"] if leased_ok else QUERIES["mark_due_lease_free"]
        text, order = fill(by_time, status=status.value, batch=int(batch)), "o.next_attempt_at"
    return text if write else _read_only(text, order)


_MARK = (
    "UPDATE outbox_operations o SET published_at = clock_timestamp() FROM due WHERE o.id = due.id\n"
    "RETURNING o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8"
)
_LOCK = re.compile(r"\s*FOR UPDATE SKIP LOCKED")


def _read_only(marking: str, order: str) -> str:
    """A mark_due query that writes nothing: the same rows answered in ``order``, no published_at
    written and no row locked (a lock is a write of the row's header too). The relay rings by count
    while it can read the broker's depth: which rows a doorbell names does not matter then."""
    if marking.count(_MARK) != 1 or not _LOCK.search(marking):
        raise ValueError("relay.sql: a mark_due query no longer ends as _read_only expects")
    read = "SELECT o.id, EXTRACT(EPOCH FROM clock_timestamp() - o.next_attempt_at)::float8\n"
    read += f"FROM outbox_operations o JOIN due ON o.id = due.id ORDER BY {order}"
    return _LOCK.sub("", marking.replace(_MARK, read))


# Every read-only shape is made once here, so a relay.sql that no longer reads as _read_only expects
# fails at import, not in a relay's tick (where it would stop the sweep behind the dispatch ring).
for _status in (Status.NOT_DISPATCHED, Status.OUTCOME_UNKNOWN):
    for _leased_ok in (False, True):
        mark_due(_status, _leased_ok, 1, write=False)

MARK_RUNG = QUERIES["mark_rung"]
LISTEN = QUERIES["listen"]
TRY_LEAD = QUERIES["try_lead"]

# -- housekeeping (housekeeping.sql) ----------------------------------------------------------------
STALE_STATISTICS = QUERIES["stale_statistics"]


def statement_timeout(ms: int) -> str:
    return fill(QUERIES["statement_timeout"], ms=int(ms))


GENERIC_PLANS = QUERIES["generic_plans"]
PLANS_AS_BEFORE = QUERIES["plans_as_before"]
MIGRATION_LOCK_SQL = QUERIES["migration_lock"]
