"""The PostgreSQL driver's statements of a fenced move: a worker's finalize (its attempt's result)
and a reconciler's settlement (its lookup's), one operation per statement or, for a doorbell's
moves that are alike, many in one (``finalize_rows``; ``finalize_batch`` says which). Their write
sets come from outbox/ledger/writes.py (``render``); the rest of the catalogue is pg_statements.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from outbox.ledger.drivers.base import FinalizeWrite
from outbox.ledger.drivers.pg_statements import EVENTS_ID_SEQ, driver_params
from outbox.ledger.effect_guard import NO_EFFECT_POSSIBLE
from outbox.ledger.models import ATTEMPTS, OPERATION_EVENTS, OPERATIONS
from outbox.ledger.request_record import RECORD_PARAMS
from outbox.ledger.states import RECONCILE_CLAIMABLE, Status
from outbox.ledger.writes import (
    ATTEMPT_REPORT,
    CANCEL_NOTE,
    Db,
    IfNull,
    Param,
    WriteSet,
    finalize_writes,
    settle_writes,
)


def render(writes: WriteSet, source: str = ":") -> str:
    """A write set (outbox/ledger/writes.py) as the SET list of an UPDATE. ``source``: what a
    parameter's name follows (``:`` a statement's parameter; ``v.p_`` a column of the JSON rows a
    multi-row statement updates from, finalize_rows)."""

    def value(column: str, v: Param | Db | IfNull) -> str:
        if isinstance(v, Param):
            return f"CAST({source}{v.name} AS {v.cast})" if v.cast else f"{source}{v.name}"
        if isinstance(v, IfNull):
            return f"CASE WHEN {v.unless} IS NULL THEN CAST({source}{v.name} AS text) ELSE {column} END"
        return {
            Db.NULL: "NULL",
            Db.NOW: "clock_timestamp()",
            Db.NOW_PLUS_DELAY: f"clock_timestamp() + make_interval(secs => {source}delay_s)",
            Db.REASON_NOTING_CANCEL: (
                f"CASE WHEN cancel_requested THEN {source}reason || '{CANCEL_NOTE}' ELSE {source}reason END"
            ),
            Db.DECREMENT: f"{column} - 1",
        }[v]

    return ", ".join(f"{column} = {value(column, v)}" for column, v in writes)


# -- finalize -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def finalize(to: Status, refund: bool, guard: bool, source: Status = Status.DISPATCHING) -> str:
    """A worker's finalize in one statement: the fenced move and its attempt row, which records the
    move's event when it moved (outbox_history shows it); an event row only if the attempt row was
    already ended (then nothing else would say the operation moved).
    (``source`` outcome_unknown or accepted: a reconciler's settlement of its lookup, ``settle_writes``.)

    ``guard``: the move claims "no effect" and must hold only while no other attempt may have
    taken effect (effect_guard.py).
    """
    writes = settle_writes(to) if source in RECONCILE_CLAIMABLE else finalize_writes(to, refund=refund)
    # A lookup claimed before migration 0015 has no claimed_from: its move's "from" is the source.
    claimed = (
        f",\n        claimed_from = coalesce(claimed_from, '{source.value}')" if source in RECONCILE_CLAIMABLE else ""
    )
    where = f"id = :operation_id AND status = '{source.value}' AND fencing_token = :token"
    if guard:
        where += " AND " + NO_EFFECT_POSSIBLE
    return driver_params(f"""
WITH moved AS (
    UPDATE {OPERATIONS} SET {render(writes)}
    WHERE {where}
    RETURNING id, fencing_token
), att AS (
    UPDATE {ATTEMPTS} SET {render(ATTEMPT_REPORT)},
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('{EVENTS_ID_SEQ}'), CAST(:to AS varchar), CAST(:event_reason AS text) FROM moved){claimed}
    WHERE id = :attempt_id AND ended_at IS NULL
    RETURNING id
), logged AS (
    INSERT INTO {OPERATION_EVENTS} (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), '{source.value}', :to, fencing_token, :event, :event_reason, :actor
    FROM moved WHERE NOT EXISTS (SELECT 1 FROM att)
)
SELECT (SELECT count(*) FROM att) AS wrote, (SELECT count(*) FROM moved) AS moved
""")


# Every parameter of a finalize (FinalizeWrite.params, ``to`` and ``stale``) with its SQL type: the
# columns of the JSON rows the multi-row finalize reads.
FINALIZE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("operation_id", "text"),
    ("token", "bigint"),
    ("attempt_id", "bigint"),
    ("to", "text"),
    ("reason", "text"),
    ("event_reason", "text"),
    ("event", "text"),
    ("actor", "text"),
    ("waiting_for", "text"),
    ("delay_s", "float8"),
    ("result", "text"),  # JSON text: cast where it is written (SUCCESS's Param cast)
    ("klass", "text"),
    ("status_code", "integer"),
    ("request_digest", "text"),
    ("provider_request_id", "text"),
    ("provider_reference", "text"),
    ("response_digest", "text"),
    ("retry_after_s", "float8"),
    ("latency_s", "float8"),
    ("error", "text"),
    ("stale", "boolean"),
    *((name, "text") for name in RECORD_PARAMS),  # the request on record (writes.RECORD_FIRST)
)


@functools.lru_cache(maxsize=32)
def finalize_rows(to: Status, refund: bool, source: Status = Status.DISPATCHING) -> str:
    """``finalize`` for many operations moved to the same ``to`` in ONE statement: ``:rows`` is a
    JSON array with one object per operation (the parameters of FINALIZE_COLUMNS by name), the
    statement answers one row (wrote, moved) per operation in their order. The same writes, fence
    and event rows as that many ``finalize`` statements: PostgreSQL's cost per statement (executor
    start, a CTE plan of three writes) is paid once per doorbell instead of once per operation.
    One JSON text, not an array per parameter: psycopg dumps arrays
    element by element in Python (~60 us per operation of worker CPU for these 21, measured), the
    json module in C (~4 us).
    No ``guard``: a move that claims "no effect" reads every other attempt of its own operation, and
    goes alone (``finalize``). The operations must be distinct (one row of ``v`` per operation).
    ``:ids`` and ``:attempt_ids``: the operations' and attempt rows' ids again, as arrays:
    PostgreSQL cannot see into the JSON when it plans (it counts 100 rows), and without them it
    scanned every row in dispatching (and their dead index entries) for the ten it moves (the
    finalize's execution per operation rose 0.11 -> 0.16 ms in bench.pg_statements), and every
    attempt row while the table is small enough for a scan to look cheaper than 100 index probes
    (below ~30,000 rows: 1.7 ms per statement at 20,000)."""
    writes = settle_writes(to) if source in RECONCILE_CLAIMABLE else finalize_writes(to, refund=refund)
    claimed = (
        f",\n        claimed_from = coalesce(claimed_from, '{source.value}')" if source in RECONCILE_CLAIMABLE else ""
    )
    columns = ", ".join(f'"{name}" {kind}' for name, kind in FINALIZE_COLUMNS)
    # v's columns are the parameters' names after "p_": none is a column of the tables it updates
    # (so no name in the statement can mean either), and none a keyword ("to").
    names = ", ".join("p_" + name for name, _ in FINALIZE_COLUMNS)
    return driver_params(f"""
WITH v AS (
    SELECT * FROM ROWS FROM (json_to_recordset(CAST(:rows AS json)) AS ({columns}))
        WITH ORDINALITY AS v({names}, ord)
), moved AS (
    UPDATE {OPERATIONS} SET {render(writes, "v.p_")}
    FROM v
    WHERE {OPERATIONS}.id = v.p_operation_id AND {OPERATIONS}.id = ANY(CAST(:ids AS text[]))
      AND status = '{source.value}' AND fencing_token = v.p_token
    RETURNING {OPERATIONS}.id, {OPERATIONS}.fencing_token
), att AS (
    UPDATE {ATTEMPTS} SET {render(ATTEMPT_REPORT, "v.p_")},
        (move_event_id, moved_to, move_reason) =
            (SELECT nextval('{EVENTS_ID_SEQ}'), CAST(v.p_to AS varchar), v.p_event_reason
             FROM moved WHERE moved.id = v.p_operation_id){claimed}
    FROM v
    WHERE {ATTEMPTS}.id = v.p_attempt_id AND {ATTEMPTS}.id = ANY(CAST(:attempt_ids AS bigint[]))
      AND ended_at IS NULL
    RETURNING {ATTEMPTS}.id
), logged AS (
    INSERT INTO {OPERATION_EVENTS} (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT moved.id, clock_timestamp(), '{source.value}', v.p_to, moved.fencing_token, v.p_event, v.p_event_reason, v.p_actor
    FROM moved JOIN v ON v.p_operation_id = moved.id
    WHERE NOT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id)
)
SELECT EXISTS (SELECT 1 FROM att WHERE att.id = v.p_attempt_id) AS wrote,
    EXISTS (SELECT 1 FROM moved WHERE moved.id = v.p_operation_id) AS moved
FROM v ORDER BY v.ord
""")


def finalize_params(w: FinalizeWrite) -> dict[str, Any]:
    """One write's parameters as ``finalize`` reads them (FINALIZE_COLUMNS, by name)."""
    params = dict(w.params, to=w.to.value, stale=False)
    if params.get("result") is not None:
        params["result"] = json.dumps(params["result"])
    return params


def json_rows(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str | None:
    """``rows`` as the JSON text a multi-row statement reads (json_to_recordset); None when a row
    cannot be spelled so (a float that is not finite, which PostgreSQL's float8 takes but JSON has
    no number for; a value of a type json does not know; a parameter missing): then each row goes
    by itself, as the one-row statement sends it. Not ASCII-escaped: escapes of non-ASCII text
    (backslash-u) fail json_to_recordset on a database not encoded in UTF8."""
    try:
        return json.dumps([{name: row[name] for name in names} for row in rows], allow_nan=False, ensure_ascii=False)
    except (ValueError, TypeError, KeyError):
        return None


_NAMES = tuple(name for name, _ in FINALIZE_COLUMNS)


def finalize_batch(
    writes: Sequence[FinalizeWrite], params: Sequence[dict[str, Any]]
) -> list[tuple[str, dict[str, Any], list[int]]]:
    """A doorbell's finalize as statements to send: (statement, its parameters, the indexes of the
    writes it answers, one result row each in that order). Writes alike (same move, no guard) go in
    one ``finalize_rows``; the rest one ``finalize`` each. The statements run in another order than
    the writes': only writes of distinct operations may be reordered, so a batch that names one
    operation twice goes one statement per write, in its order."""
    groups: dict[tuple[Status, bool, Status], list[int]] = {}
    alone: list[int] = []
    distinct = len({p["operation_id"] for p in params}) == len(params)
    for i, w in enumerate(writes):
        (alone if w.guard or not distinct else groups.setdefault((w.to, w.refund, w.source), [])).append(i)
    out: list[tuple[str, dict[str, Any], list[int]]] = []
    for (to, refund, source), members in groups.items():
        doc = json_rows([params[i] for i in members], _NAMES) if len(members) > 1 else None
        if doc is None:
            alone += members
        else:
            ids = [params[i]["operation_id"] for i in members]
            attempt_ids = [params[i]["attempt_id"] for i in members]
            out.append(
                (finalize_rows(to, refund, source), {"rows": doc, "ids": ids, "attempt_ids": attempt_ids}, members)
            )
    for i in sorted(alone):
        w = writes[i]
        out.append((finalize(w.to, w.refund, w.guard, w.source), params[i], [i]))
    return out
