"""The PostgreSQL catalogue reads the same in psycopg's ``%(name)s`` and SQLAlchemy's ``:name``
(outbox/ledger/drivers/pg_statements.py, ``named``): every statement a caller's transaction on
another driver (psycopg2, asyncpg, psycopg's async connection) may be sent converts, parameter for
parameter, and none casts a parameter as ``%(name)s::type``, which SQLAlchemy would not read."""

from __future__ import annotations

import json
import re

import pytest

from outbox.ledger.drivers import pg_moves as moves
from outbox.ledger.drivers import pg_statements as sql
from outbox.ledger.drivers.base import FinalizeWrite
from outbox.ledger.states import RECONCILE_CLAIMABLE, AttemptKind, Status
from outbox.ledger.writes import SETTLE_WRITES_FOR

STATEMENTS = {
    name: value
    for name, value in vars(sql).items()
    if name.isupper()
    and not name.startswith("_")
    and isinstance(value, str)
    and re.match(r"\s*(WITH|SELECT|INSERT|UPDATE)\b", value)
}
SHAPES = {
    "claim": [
        sql.claim(kind, ids, 10, others, fair)
        for kind in AttemptKind
        for ids in (False, True)
        for others in (0, 5)
        for fair in (False, True)
    ],
    "finalize": [
        moves.finalize(to, refund, guard) for to in Status for refund in (False, True) for guard in (False, True)
    ],
    "finalize_rows": [moves.finalize_rows(to, refund) for to in Status for refund in (False, True)],
    "settle": [
        moves.finalize(to, False, False, source) for to in SETTLE_WRITES_FOR for source in sorted(RECONCILE_CLAIMABLE)
    ],
    "settle_rows": [
        moves.finalize_rows(to, False, source) for to in SETTLE_WRITES_FOR for source in sorted(RECONCILE_CLAIMABLE)
    ],
    "mark_due": [
        sql.mark_due(status, leased, 100, write)
        for status in Status
        for leased in (False, True)
        for write in (True, False)
    ],
    "attempt_log": [sql.attempt_log(("id", "attempt_class"))],
}


def _params(statement: str, pattern: str) -> list[str]:
    return re.findall(pattern, statement)


@pytest.mark.parametrize(
    "statement",
    [*STATEMENTS.values(), *(s for shapes in SHAPES.values() for s in shapes)],
    ids=[*STATEMENTS, *(f"{k}-{i}" for k, shapes in SHAPES.items() for i, _ in enumerate(shapes))],
)
def test_every_statement_reads_the_same_with_sqlalchemy_parameters(statement):
    named = sql.named(statement)
    assert "%(" not in named
    assert _params(named, r"(?<![:\w]):(\w+)(?![:\w])") == _params(statement, r"%\((\w+)\)s")


def test_submit_is_in_the_catalogue_and_a_cast_parameter_is_refused():
    assert {"SUBMIT_NOTIFY", "SUBMIT_QUIET", "NOTIFY_DUE", "CURRENT_ROW"} <= set(STATEMENTS)
    with pytest.raises(ValueError, match="CAST"):
        sql.named("SELECT %(x)s::float8")


def _write(op: str, to: Status = Status.SUCCEEDED, guard: bool = False, **params: object) -> FinalizeWrite:
    base = {name: None for name, _ in moves.FINALIZE_COLUMNS if name not in ("to", "stale")}
    return FinalizeWrite(to, False, guard, {**base, "operation_id": op, "token": 1, "attempt_id": 1, **params})


def _batch(writes: list[FinalizeWrite]) -> list[tuple[str, list[int]]]:
    params = [moves.finalize_params(w) for w in writes]
    return [("rows" if "rows" in p else "one", members) for _, p, members in moves.finalize_batch(writes, params)]


def test_a_doorbells_finalize_groups_alike_moves_and_sends_the_rest_one_by_one():
    writes = [
        _write("a"),
        _write("b", Status.NOT_DISPATCHED),
        _write("c"),
        _write("d", Status.FAILED_BEFORE_COMMIT, guard=True),
        _write("e", reason="refusé"),
    ]
    assert _batch(writes) == [("rows", [0, 2, 4]), ("one", [1]), ("one", [3])]
    # One operation twice: nothing is reordered.
    assert _batch([_write("a"), _write("b"), _write("a")]) == [("one", [0]), ("one", [1]), ("one", [2])]
    # No JSON spelling (a float that is not finite, a type json does not know): one by one.
    assert _batch([_write("a", retry_after_s=float("inf")), _write("b")]) == [("one", [0]), ("one", [1])]
    assert _batch([_write("a", error=object()), _write("b")]) == [("one", [0]), ("one", [1])]


def test_json_rows_keep_text_as_it_is():
    doc = moves.json_rows([{"reason": "refusé \u00e9 拒否"}], ["reason"])
    assert doc is not None and "refusé" in doc and json.loads(doc) == [{"reason": "refusé \u00e9 拒否"}]
