"""The PostgreSQL driver's fenced moves: a worker's finalize (its attempt's result) and a
reconciler's settlement (its lookup's), one operation per statement or, for a doorbell's moves that
are alike, many in one (``finalize_rows``; ``finalize_batch`` says which). The statements are
outbox/ledger/drivers/sql/moves.sql; what a move writes on the operation row is its write set
(outbox/ledger/writes.py, shared with the SQLite driver), rendered into their ``{writes}``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from outbox.ledger.drivers.base import FinalizeWrite
from outbox.ledger.drivers.pg_statements import QUERIES, fill
from outbox.ledger.request_record import RECORD_PARAMS
from outbox.ledger.states import RECONCILE_CLAIMABLE, Status
from outbox.ledger.writes import (
    CANCEL_NOTE,
    Db,
    IfNull,
    Param,
    WriteSet,
    finalize_writes,
    settle_writes,
)


def render(writes: WriteSet, rows: str | None = None) -> str:
    """A write set (outbox/ledger/writes.py) as the SET list of an UPDATE: the ``{writes}`` of
    moves.sql. A parameter is the statement's (``%(name)s``), or with ``rows`` a column of the JSON
    rows a multi-row statement updates from (``v.p_``: ``v.p_name``, finalize_rows)."""

    def param(name: str) -> str:
        return f"%({name})s" if rows is None else f"{rows}{name}"

    def value(column: str, v: Param | Db | IfNull) -> str:
        if isinstance(v, Param):
            return f"CAST({param(v.name)} AS {v.cast})" if v.cast else param(v.name)
        if isinstance(v, IfNull):
            return f"CASE WHEN {v.unless} IS NULL THEN CAST({param(v.name)} AS text) ELSE {column} END"
        return {
            Db.NULL: "NULL",
            Db.NOW: "clock_timestamp()",
            Db.NOW_PLUS_DELAY: f"clock_timestamp() + make_interval(secs => {param('delay_s')})",
            Db.REASON_NOTING_CANCEL: (
                f"CASE WHEN cancel_requested THEN {param('reason')} || '{CANCEL_NOTE}' ELSE {param('reason')} END"
            ),
            Db.DECREMENT: f"{column} - 1",
        }[v]

    return ", ".join(f"{column} = {value(column, v)}" for column, v in writes)


# -- finalize -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def finalize(to: Status, refund: bool, guard: bool, source: Status = Status.DISPATCHING) -> str:
    """A worker's finalize in one statement (moves.sql ``finalize``): the fenced move and its
    attempt row, which records the move's event when it moved (outbox_history shows it); an event
    row only if the attempt row was already ended (then nothing else would say the operation moved).
    (``source`` outcome_unknown or accepted: a reconciler's settlement of its lookup, ``settle``.)

    ``guard``: the move claims "no effect" and must hold only while no other attempt may have
    taken effect (effect_guard.py; ``finalize_if_no_effect``). A worker's moves only: a
    settlement that claims "no effect" writes its proof with it (settlement.settle_if_fenced).
    """
    if source in RECONCILE_CLAIMABLE:
        if guard:
            raise ValueError(f"no guarded settlement from {source.value}: settle it with settle_if_fenced")
        return fill(QUERIES["settle"], writes=render(settle_writes(to)), source=source.value)
    _dispatching(source)
    writes = render(finalize_writes(to, refund=refund))
    return fill(QUERIES["finalize_if_no_effect"] if guard else QUERIES["finalize"], writes=writes)


def _dispatching(source: Status) -> None:
    if source is not Status.DISPATCHING:
        raise ValueError(
            f"a finalize moves from dispatching, a settlement from outcome_unknown or accepted: not {source.value}"
        )


# Every parameter of a finalize (FinalizeWrite.params, ``to`` and ``stale``) with its SQL type: the
# columns of the JSON rows the multi-row finalize reads (moves.sql ``finalize_rows``, in its order).
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
    """``finalize`` for many operations moved to the same ``to`` in ONE statement (moves.sql
    ``finalize_rows`` and ``settle_rows`` say how, and why it pays). No ``guard``: a move that
    claims "no effect" goes alone (``finalize``)."""
    if source in RECONCILE_CLAIMABLE:
        return fill(QUERIES["settle_rows"], writes=render(settle_writes(to), "v.p_"), source=source.value)
    _dispatching(source)
    return fill(QUERIES["finalize_rows"], writes=render(finalize_writes(to, refund=refund), "v.p_"))


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
