"""The PostgreSQL driver's SQL files (outbox/ledger/drivers/sql/*.sql): every named query is there
once, whole and used; placeholders are only those each file documents; the conditions also spelled
in Python (for the SQLite driver and the moves built with SQLAlchemy) read the same in both; and
the shapes of one statement differ only where their names say."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from outbox.ledger.drivers import pg_moves as moves
from outbox.ledger.drivers import pg_statements as sql
from outbox.ledger.effect_guard import NO_EFFECT_POSSIBLE, may_have_taken_effect
from outbox.ledger.models import ATTEMPTS, EVIDENCE, OPERATION_EVENTS, OPERATIONS, RECONCILE_DUE
from outbox.ledger.request_record import left_versions_sql
from outbox.ledger.states import Status
from outbox.ledger.writes import ATTEMPT_REPORT

ROOT = Path(__file__).resolve().parents[2]
SQL_DIR = ROOT / "outbox" / "ledger" / "drivers" / "sql"
FILES = sorted(SQL_DIR.glob("*.sql"))
Q = sql.QUERIES


def _norm(text: str) -> str:
    return " ".join(text.split())


def _blocks(path: Path) -> list[tuple[str, str]]:
    header, *rest = re.split(r"^-- name: (\w+)[ \t]*$", path.read_text(), flags=re.MULTILINE)
    return list(zip(rest[::2], rest[1::2]))


def _header(path: Path) -> str:
    return re.split(r"^-- name: ", path.read_text(), maxsplit=1, flags=re.MULTILINE)[0]


def test_every_name_is_unique_and_every_block_holds_a_statement():
    names = [name for path in FILES for name, _ in _blocks(path)]
    assert FILES and names
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    for path in FILES:
        for name, block in _blocks(path):
            statement = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("--")]
            assert statement, f"{path.name}: {name} has no statement"
            assert _norm(Q[name]) == _norm("\n".join(statement)), name
            assert re.match(r"(WITH|SELECT|INSERT|UPDATE|SET|LISTEN)\b", Q[name]), name
    assert set(Q) == set(names)


def test_every_name_the_code_asks_for_exists_and_every_query_is_asked_for():
    asked: set[str] = set()
    for path in (ROOT / "outbox").rglob("*.py"):
        source = path.read_text()
        # A name is always written out, so that this test (and grep) finds every use.
        assert not re.search(r"QUERIES\[(?![\"']\w+[\"']\])", source), f"{path}: QUERIES[...] with a computed name"
        asked |= set(re.findall(r"QUERIES\[[\"'](\w+)[\"']\]", source))
    assert sorted(asked - set(Q)) == [], "asked for, not in the SQL files"
    assert sorted(set(Q) - asked) == [], "in the SQL files, never asked for"


def test_whole_line_comments_are_for_the_reader_and_not_sent():
    for name, text in Q.items():
        assert not any(line.lstrip().startswith("--") for line in text.splitlines()), name


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_placeholders_are_only_those_the_file_documents(path):
    documented = set(re.findall(r"^--\s+\{(\w+)\}", _header(path), flags=re.MULTILINE))
    used = {p for name, _ in _blocks(path) for p in re.findall(r"\{(\w+)\}", Q[name])}
    assert used == documented


def test_fill_takes_every_placeholder_and_only_those():
    assert sql.fill("LIMIT {limit}", limit=3) == "LIMIT 3"
    with pytest.raises(KeyError):
        sql.fill("LIMIT {limit} OFFSET {others}", limit=3)
    with pytest.raises(KeyError):
        sql.fill("LIMIT {limit}", limit=3, others=1)


def test_the_tables_named_are_the_models_tables():
    named = {t for text in Q.values() for t in re.findall(r"\boutbox_\w+", text)}
    known = {OPERATIONS, ATTEMPTS, OPERATION_EVENTS, EVIDENCE, f"{OPERATION_EVENTS}_id_seq", sql.NOTIFY_CHANNEL}
    assert named <= known
    for name in ("submit_notify", "notify_due", "listen"):
        assert sql.NOTIFY_CHANNEL in Q[name]


CLAIMS = sorted(n for n in Q if n.startswith("claim_"))
DISPATCH_CLAIMS = [n for n in CLAIMS if n.startswith("claim_dispatch_")]
LOOKUP_CLAIMS = [n for n in CLAIMS if n.startswith("claim_lookups_")]


def test_the_claims_spell_the_ledgers_conditions_as_python_does():
    """effect_guard.py, request_record.py and models.py spell these for the SQLite driver too."""
    assert DISPATCH_CLAIMS and LOOKUP_CLAIMS
    for name in CLAIMS:
        assert _norm(may_have_taken_effect("c")) in _norm(Q[name]), name
    for name in DISPATCH_CLAIMS:
        assert _norm(left_versions_sql("c", "string_agg(DISTINCT {}, ',')")) in _norm(Q[name]), name
    for name in LOOKUP_CLAIMS:
        assert RECONCILE_DUE in Q[name], name
    guard = _norm(sql.driver_params(NO_EFFECT_POSSIBLE))
    assert [n for n in Q if guard in _norm(Q[n])] == ["finalize_if_no_effect"]


def test_the_moves_spell_the_attempt_report_and_the_json_columns_as_python_does():
    for name in ("finalize", "finalize_if_no_effect", "settle"):
        assert _norm(moves.render(ATTEMPT_REPORT)) in _norm(Q[name]), name
    columns = ", ".join(f'"{name}" {kind}' for name, kind in moves.FINALIZE_COLUMNS)
    names = ", ".join("p_" + name for name, _ in moves.FINALIZE_COLUMNS)
    for name in ("finalize_rows", "settle_rows"):
        assert _norm(moves.render(ATTEMPT_REPORT, "v.p_")) in _norm(Q[name]), name
        assert f"AS ({columns}))" in _norm(Q[name]) and f"AS v({names}, ord)" in _norm(Q[name]), name
    records = ", ".join(f"{c} text" for c in sql.EVIDENCE_COLUMNS)
    assert f"AS r({records})" in _norm(Q["insert_evidence_rows"])


def _tail(name: str) -> str:
    return _norm(Q[name][Q[name].index("claimed AS (") :])


def _changed(a: str, b: str) -> tuple[list[str], list[str]]:
    """The lines only in ``a`` and those only in ``b`` (whitespace normalised)."""
    la, lb = [_norm(x) for x in Q[a].splitlines()], [_norm(x) for x in Q[b].splitlines()]
    diff = list(difflib.ndiff(la, lb))
    return [d[2:] for d in diff if d.startswith("- ")], [d[2:] for d in diff if d.startswith("+ ")]


def test_the_shapes_of_one_statement_differ_only_where_their_names_say():
    # Every claim of a kind ends the same way (claimed, numbered, opened), whatever chose its rows.
    assert len({_tail(n) for n in DISPATCH_CLAIMS}) == 1
    assert len({_tail(n) for n in LOOKUP_CLAIMS}) == 1
    # Fair: the ranking, nothing else.
    unfair = "SELECT c.id, row_number() OVER (ORDER BY c.given DESC, c.priority DESC, c.next_attempt_at) AS rank"
    fair = (
        "SELECT c.id, row_number() OVER (ORDER BY c.turn / coalesce(wt.weight, 1),"
        " c.tenant <= CAST(%(after_tenant)s AS varchar), c.tenant) AS rank"
    )
    for name in ("claim_dispatch_due", "claim_dispatch_given_then_due"):
        assert _changed(name, name + "_fair") == ([unfair], [fair])
    # Given ids: the wanted rows are those ids, and the others are not.
    assert _changed("claim_dispatch_due", "claim_dispatch_given_then_due") == (
        [
            "WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp() AND false",
            "LIMIT 0",
            "WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp()",
            "LIMIT {limit}",
            "LIMIT {limit}",
        ],
        [
            "WHERE status = 'not_dispatched' AND next_attempt_at <= clock_timestamp()"
            " AND id = ANY(CAST(%(operation_ids)s AS varchar[]))",
            "LIMIT {wanted}",
            "WHERE o.status = 'not_dispatched' AND o.tenant = t.tenant AND o.next_attempt_at <= statement_timestamp()"
            " AND NOT (id = ANY(CAST(%(operation_ids)s AS varchar[])))",
            "LIMIT {take}",
            "LIMIT {take}",
        ],
    )
    # The relay walks the tenants as a claim does, from the first.
    walk = _norm(Q["claim_dispatch_due"][: Q["claim_dispatch_due"].index("weighted AS")])
    assert walk.replace("CAST(%(after_tenant)s AS varchar)", "''") in _norm(Q["mark_due_by_tenant"])
    # Lease free: the lease, nothing else.
    lease = "AND (lease_expires_at IS NULL OR lease_expires_at < clock_timestamp())"
    for name in ("mark_due", "mark_due_by_tenant"):
        assert _changed(name, name + "_lease_free") == ([], [lease])
    # The guard, nothing else.
    removed, added = _changed("finalize", "finalize_if_no_effect")
    assert removed == [] and _norm(" ".join(added)) == _norm("AND " + sql.driver_params(NO_EFFECT_POSSIBLE))
    assert Q["submit_notify"].replace(", pg_notify('outbox_due', id) AS notified", "") == Q["submit_quiet"]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_comments_say_what_is_and_leave_history_to_git(path):
    """As test_layout.py asks of docstrings: no issue of ours, no benchmarks' notes."""
    citing = re.compile(r"\b[Ii]ssues? #?\d+|bench/README\.md|\bstop \d+\b")
    assert [line for line in path.read_text().splitlines() if citing.search(line)] == []


def test_a_move_has_a_statement_only_from_where_it_can_start():
    """A finalize moves from dispatching, a settlement from outcome_unknown or accepted, and a
    settlement that claims "no effect" writes its proof with it (settlement.settle_if_fenced)."""
    with pytest.raises(ValueError, match="guarded settlement"):
        moves.finalize(Status.FAILED_BEFORE_COMMIT, False, True, Status.OUTCOME_UNKNOWN)
    with pytest.raises(ValueError, match="not_dispatched"):
        moves.finalize(Status.SUCCEEDED, False, False, Status.NOT_DISPATCHED)
    with pytest.raises(ValueError, match="not_dispatched"):
        moves.finalize_rows(Status.SUCCEEDED, False, Status.NOT_DISPATCHED)
