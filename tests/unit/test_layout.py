"""The shape of the code, checked: what issues 13 and 30 promised stays true as the code grows.

- no product module over 400 lines;
- no import cycle between product modules (lazy imports inside functions count too);
- only the ledger drivers (outbox/ledger/drivers/) ask which database they run on;
- SQL text lives in outbox/ only; writes to the ledger's tables happen in outbox/ only.
- inside outbox/, rooms import only rooms on floors below their own (ledger first, service last);
- inside workers/, the same (provider, ground, pacing, engine, then dispatch/reconcile/relay/webhooks
  side by side and never importing each other, wiring as the roof, the operator face and tooling on top);
- the sandbox (the fake provider) imports nothing of the system it fakes;
- docstrings cite no issue of ours and not the benchmarks' notes: history is in git.
- the tests import nothing of bench/ (bench uses what the tests share).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Exactly the four packages the project was specified with (pyproject's packages.find says the same).
PACKAGES = ("outbox", "producer", "workers", "breaker")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "migrations" in path.parts:
                continue  # alembic scripts: frozen history, not modules we import
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                # ``from pkg import submodule`` imports the submodule, not the package's own code.
                out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


def test_no_product_module_is_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert {n: c for n, c in long.items() if c > MAX_LINES} == {}


def test_dependencies_point_inward_to_the_ledger():
    """The ledger (outbox) imports no other package; the producer (what agents call, embedded in an
    application beside its own ``workers`` package) imports only the ledger; breakers know nothing
    of the ledger; only workers (the processes) import everything."""
    allowed = {
        "outbox": {"outbox"},
        "producer": {"outbox", "producer"},
        "breaker": {"breaker"},
        "workers": {"outbox", "producer", "workers", "breaker"},
    }
    wrong = sorted(
        (name, dep)
        for name, path in MODULES.items()
        for dep in _imports(name, path)
        if dep.split(".")[0] not in allowed[name.split(".")[0]]
    )
    assert wrong == []


def test_the_ledger_knows_no_http_celery_or_argparse():
    banned = re.compile(r"^\s*(from|import) (fastapi|starlette|httpx|celery|kombu|argparse|aiohttp|uvicorn)\b", re.M)
    assert sorted(n for n, p in MODULES.items() if n.startswith("outbox") and banned.search(p.read_text())) == []


def test_no_import_cycle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def _outside(prefix: str) -> dict[str, str]:
    return {n: p.read_text() for n, p in MODULES.items() if not n.startswith(prefix)}


def test_only_the_drivers_ask_which_database_they_run_on():
    asking = re.compile(r"""is_postgres|dialect\.name|get_backend_name|== ["'](postgresql|sqlite)["']""")
    assert sorted(n for n, src in _outside("outbox.ledger.drivers").items() if asking.search(src)) == []


def test_sql_text_lives_in_outbox_only():
    sql = re.compile(r"[\"'](?:\s*)(SELECT\s|INSERT\s+INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s|WITH\s+\w+\s+AS)")
    offenders = sorted(n for n, src in _outside("outbox").items() if sql.search(src))
    assert offenders == []


@pytest.mark.parametrize("model", ["Operation", "Attempt", "OperationEvent"])
def test_ledger_tables_are_written_in_outbox_only(model):
    write = re.compile(rf"\b(insert|update|delete)\(\s*{model}\b|core_table\(\s*{model}\s*\)")
    assert sorted(n for n, src in _outside("outbox").items() if write.search(src)) == []


def test_surfaces_call_the_service_layer_not_each_others_routes():
    """The console, the command line and the agent tools read and decide through the service layer
    (outbox/service/, workers/service/), never through the HTTP API's route modules; and the service
    layer is the ledger's top floor: nothing else in outbox imports it."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    routes = {
        n
        for n, p in MODULES.items()
        if n.startswith(("producer.http", "workers.server")) and "APIRouter(" in p.read_text()
    }
    surfaces = ("workers.console", "workers.cli", "producer.agents", "workers.service")
    assert sorted((n, d) for n, deps in graph.items() if n.startswith(surfaces) for d in deps if d in routes) == []
    below = [n for n in MODULES if n.startswith("outbox.") and not n.startswith("outbox.service")]
    assert sorted((n, d) for n in below for d in graph[n] if d.startswith("outbox.service")) == []


# The ledger's rooms, lowest floor first: a room imports only rooms on floors below its own.
# errors and settings sit under every room; migrate and testing stand above them all.
OUTBOX_ROOMS = ("ledger", "privacy", "actions", "access", "runs", "evidence", "reads", "approvals", "service")
OUTBOX_BASE = ("errors", "settings")
OUTBOX_TOP = ("migrate", "testing")


def _floor(module: str) -> int:
    room = module.split(".")[1]
    if room in OUTBOX_BASE:  # settings reads errors: the base has its own order
        return OUTBOX_BASE.index(room) - len(OUTBOX_BASE)
    if room in OUTBOX_TOP:
        return len(OUTBOX_ROOMS)
    return OUTBOX_ROOMS.index(room)


def test_every_ledger_module_lives_in_a_known_room():
    rooms = set(OUTBOX_ROOMS) | set(OUTBOX_BASE) | set(OUTBOX_TOP)
    assert sorted(n for n in MODULES if n.startswith("outbox.") and n.split(".")[1] not in rooms) == []


def test_the_ledgers_rooms_import_only_rooms_before_them():
    """outbox/ is rooms by concept (docs/explanation/architecture.md's layout table); the order is the direction: the core
    (ledger) knows no run, approval or report; runs know no evidence; the service layer is the top."""
    upward = sorted(
        (name, dep)
        for name, path in MODULES.items()
        if name.startswith("outbox.")
        for dep in _imports(name, path)
        if dep.startswith("outbox.") and dep.split(".")[1] != name.split(".")[1] and _floor(dep) >= _floor(name)
    )
    assert upward == []


def test_the_sandbox_shares_no_code_with_what_it_fakes():
    """The fake provider (workers/sandbox/) imports nothing of outbox, producer, breaker or the rest of
    workers: a bug in shared code would be on both sides of every test and never be seen."""
    borrowed = {
        name: sorted(m for m in _imports(name, path) if not m.startswith("workers.sandbox"))
        for name, path in MODULES.items()
        if name.startswith("workers.sandbox")
    }
    assert {name: found for name, found in borrowed.items() if found} == {}


def test_docstrings_say_what_is_and_leave_history_to_git():
    """No product module cites an issue of ours or the benchmarks' notes for its reasons: a docstring
    says what is and why; which issue asked for it is in git (migrations, frozen history, excepted)."""
    citing = re.compile(r"\b[Ii]ssues? #?\d+|bench/README\.md|\bstop \d+\b")
    found = {
        name: [line.strip() for line in path.read_text().splitlines() if citing.search(line)]
        for name, path in MODULES.items()
    }
    external = re.compile(r"\b(uvicorn|celery|kombu|redis|sqlalchemy|psycopg) issue #?\d+", re.IGNORECASE)
    ours = {n: [x for x in lines if not external.search(x)] for n, lines in found.items()}
    assert {n: lines for n, lines in ours.items() if lines} == {}


def test_the_tests_import_nothing_of_the_benchmarks():
    """bench/ uses what the tests share (tests/harness.py, tests/loads/, tests/pg_cluster.py), never the
    other way round: a test must not depend on a benchmark's command."""
    found = {}
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            if any(n == "bench" or n.startswith("bench.") for n in names):
                found.setdefault(str(path.relative_to(ROOT)), []).extend(names)
    assert found == {}


# The workers' rooms, lowest floor first. A room imports only rooms on floors below its own; rooms
# on one floor (dispatch, reconcile, relay, webhooks) never import each other. provider is the
# provider contract (the actions file, connectors, classification); ground is what every process
# uses to be seen (metrics, logs, tracing, heartbeat, outages); engine is the machinery dispatch
# and reconcile share (the in-flight pool, room, committer, downstream, doorbell, queue names, late
# successes, handoff packet, outcomes); wiring is the roof of the worker processes (the Celery app,
# tasks, runtime, builders from Settings); the operator face and the tooling stand on top. The
# sandbox (the fake provider) is on no floor: it imports nothing of ours at all (the test above).
WORKERS_FLOORS: tuple[tuple[str, ...], ...] = (
    ("provider",),
    ("ground",),
    ("pacing",),
    ("engine",),
    ("dispatch", "reconcile", "relay", "webhooks"),
    ("wiring",),
    ("service",),
    ("console",),
    ("server",),
    ("cli",),
    ("testkit",),
)
WORKERS_APART = ("sandbox",)


def _workers_floor(module: str) -> int:
    room = module.split(".")[1]
    if room in WORKERS_APART:
        return -1
    return next(i for i, rooms in enumerate(WORKERS_FLOORS) if room in rooms)


def test_every_workers_module_lives_in_a_known_room():
    rooms = {r for floor in WORKERS_FLOORS for r in floor} | set(WORKERS_APART)
    assert sorted(n for n in MODULES if n.startswith("workers.") and n.split(".")[1] not in rooms) == []


def test_the_workers_rooms_import_only_rooms_below_them():
    """A line in workers/dispatch/ can tell from its folder what it may touch: the engine and what is
    under it, never reconcile, relay or the Celery wiring; no two rooms import each other."""
    upward = sorted(
        (name, dep)
        for name, path in MODULES.items()
        if name.startswith("workers.") and name.count(".") > 1
        for dep in _imports(name, path)
        if dep.startswith("workers.")
        and dep.count(".") > 1
        and dep.split(".")[1] != name.split(".")[1]
        and dep.split(".")[1] not in WORKERS_APART
        and _workers_floor(dep) >= _workers_floor(name)
    )
    assert upward == []
