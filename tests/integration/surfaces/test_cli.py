"""The `agent-outbox` CLI as a real subprocess, on the embedded default (SQLite) and on PostgreSQL.

Exit codes are a contract (workers/cli/main.py): 0 done, 1 failed at run time, 2 invalid input,
3 idempotency conflict. After every bad input, nothing already stored may change.
Independent invocations run in parallel: each pays ~1 s of interpreter start-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from outbox.ledger.envelope import build_envelope
from tests import spawn

CLI_TIMEOUT_S = 60.0  # far above a normal run (~1-2 s); a hang fails the test instead of the run
FIELDS = {
    "operation_id",
    "tenant",
    "idempotency_key",
    "action",
    "status",
    "attempts",
    "fencing_token",
    "result",
    "error_class",
    "created_at",
    "updated_at",
}


class Cli:
    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env = cwd, env

    def start(self, *args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> Any:
        full_env = {k: v for k, v in (self.env | (env or {})).items() if v is not None}
        proc = spawn.popen(
            [sys.executable, "-m", "workers.cli.main", *args],
            cwd=self.cwd,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return proc, stdin

    @staticmethod
    def finish(started: Any) -> subprocess.CompletedProcess[str]:
        proc, stdin = started
        out, err = proc.communicate(stdin, timeout=CLI_TIMEOUT_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def __call__(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.finish(self.start(*args, **kw))

    def many(self, *calls: tuple[Any, ...]) -> list[subprocess.CompletedProcess[str]]:
        """Run independent invocations at once; each call is (args tuple, kwargs dict)."""
        started = [self.start(*args, **kw) for args, kw in calls]
        return [self.finish(s) for s in started]

    def ops(self) -> list[dict[str, Any]]:
        r = self("ops", "list", "--json", "--limit", "1000")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


def _base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATA_DIR"] = str(tmp_path / "data")
    env["COLUMNS"] = "200"
    return env


@pytest.fixture(params=["sqlite", "postgres"])
def cli(request: pytest.FixtureRequest, tmp_path: Path) -> Cli:
    if request.param == "postgres":
        url = request.getfixturevalue("pg_ledger").url  # migrated and emptied
    else:
        url = f"sqlite:///{tmp_path / 'fresh' / 'outbox.ledger.db'}"  # nothing there yet: migrate creates it
    return Cli(tmp_path, _base_env(tmp_path) | {"OUTBOX_DATABASE_URL": url})


def _receipt(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_migrate_submit_list_show(cli: Cli) -> None:
    first, again = cli("migrate"), cli("migrate")
    assert first.returncode == 0 and again.returncode == 0, (first.stderr, again.stderr)
    assert "already at" in again.stdout  # idempotent

    new = _receipt(
        cli(
            "submit",
            "--action",
            "payments.refund.create",
            "--key",
            "wf-1:refund:v1",
            "--tenant",
            "acme",
            "--args",
            '{"order_id": "o-1", "amount": 10.50, "currency": "EUR"}',
        )
    )
    assert new["new"] is True and new["status"] == "not_dispatched"
    # Exact decimals: 10.50 in JSON text is the Decimal 10.5, never the binary float 10.5000000000000001...
    assert (
        new["args_digest"]
        == build_envelope(
            tenant="acme",
            action="payments.refund.create",
            subject="cli",
            args={"order_id": "o-1", "amount": Decimal("10.5"), "currency": "EUR"},
        ).digest
    )
    # The same intent written differently (key order, trailing zero) is the same operation.
    same, tiny = cli.many(
        (
            (
                "submit",
                "--action",
                "payments.refund.create",
                "--key",
                "wf-1:refund:v1",
                "--tenant",
                "acme",
                "--args",
                '{"currency": "EUR", "amount": 10.5, "order_id": "o-1"}',
            ),
            {},
        ),
        (
            (
                "submit",
                "--action",
                "payments.refund.create",
                "--key",
                "wf-2:refund:v1",
                "--tenant",
                "acme",
                "--args",
                '{"amount": 0.1}',
                "--priority",
                "5",
            ),
            {},
        ),
    )
    same = _receipt(same)
    assert same["new"] is False and same["operation_id"] == new["operation_id"]
    tiny = _receipt(tiny)
    assert (
        tiny["args_digest"]
        == build_envelope(
            tenant="acme", action="payments.refund.create", subject="cli", args={"amount": Decimal("0.1")}
        ).digest
    )

    ops = cli.ops()
    assert len(ops) == 2
    for op in ops:
        assert FIELDS <= set(op), FIELDS - set(op)
    by_key = {op["idempotency_key"]: op for op in ops}
    assert by_key["wf-1:refund:v1"]["operation_id"] == new["operation_id"]
    assert by_key["wf-1:refund:v1"]["attempts"] == 0 and by_key["wf-1:refund:v1"]["fencing_token"] == 0
    assert (by_key["wf-1:refund:v1"]["priority"], by_key["wf-2:refund:v1"]["priority"]) == (0, 5)

    listed, show_id, show_key, table = cli.many(
        (("ops", "list", "--status", "not_dispatched", "--json"), {}),
        (("ops", "show", new["operation_id"], "--json"), {}),
        (("ops", "show", "wf-1:refund:v1"), {}),
        (("ops", "list"), {}),
    )
    assert listed.returncode == 0 and {o["status"] for o in json.loads(listed.stdout)} == {"not_dispatched"}
    assert show_id.returncode == 0, show_id.stderr
    detail = json.loads(show_id.stdout)
    assert detail["operation_id"] == new["operation_id"] and detail["attempt_log"] == []
    assert [(e["from"], e["to"], e["event"]) for e in detail["history"]] == [(None, "not_dispatched", "submit")]
    assert show_key.returncode == 0, show_key.stderr
    assert new["operation_id"] in show_key.stdout and "history" in show_key.stdout and "attempts" in show_key.stdout
    assert detail["priority"] == 0 and "priority 0" in show_key.stdout
    assert table.returncode == 0, table.stderr
    assert "2 operation(s)" in table.stdout and "wf-1:refund:v1" in table.stdout
    assert "status" in table.stdout and "─" in table.stdout  # a table, not JSON
    assert not table.stdout.lstrip().startswith("[")


def test_bad_input_exits_with_its_code_and_changes_nothing(cli: Cli) -> None:
    assert cli("migrate").returncode == 0
    good = '{"order_id": "o-1", "amount": "10.50"}'
    _receipt(cli("submit", "--action", "payments.refund.create", "--key", "k1", "--args", good))
    before = cli.ops()
    conflict, bad_json, missing_key, float_like = cli.many(
        (
            (
                "submit",
                "--action",
                "payments.refund.create",
                "--key",
                "k1",
                "--args",
                '{"order_id": "o-1", "amount": "99"}',
            ),
            {},
        ),
        (("submit", "--action", "payments.refund.create", "--key", "k2", "--args", '{"amount": '), {}),
        (("submit", "--action", "payments.refund.create", "--args", good), {}),
        (("submit", "--action", "payments.refund.create", "--key", "k3", "--args", '{"amount": NaN}'), {}),
    )
    assert conflict.returncode == 3, conflict.stderr
    assert "idempotency conflict" in conflict.stderr and "'k1'" in conflict.stderr
    assert bad_json.returncode == 2 and "--args" in bad_json.stderr and "JSON" in bad_json.stderr
    assert missing_key.returncode == 2 and "--key" in missing_key.stderr
    assert float_like.returncode == 2 and "NaN" in float_like.stderr
    for r in (conflict, bad_json, missing_key, float_like):
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stdout.strip() == "", r.stdout  # errors go to stderr, never mixed into JSON output
    assert cli.ops() == before


def test_bad_settings_name_the_variable_and_change_nothing(sqlite_database_url: str, tmp_path: Path) -> None:
    # Settings are read before any backend is touched, so one backend is enough here.
    cli = Cli(tmp_path, _base_env(tmp_path) | {"OUTBOX_DATABASE_URL": sqlite_database_url})
    before = cli.ops()
    pg_down = "postgresql+psycopg://postgres@127.0.0.1:1/nothing"
    bad_lease, mysql, unreachable, help_ = cli.many(
        (("ops", "list", "--json"), {"env": {"OUTBOX_LEASE_S": "-1"}}),
        (("submit", "--action", "a.b", "--key", "k", "--args", "{}"), {"env": {"OUTBOX_DATABASE_URL": "mysql://x"}}),
        (("ops", "list", "--json"), {"env": {"OUTBOX_DATABASE_URL": pg_down}}),
        (("sandbox", "--help"), {}),
    )
    assert bad_lease.returncode == 2 and "OUTBOX_LEASE_S" in bad_lease.stderr
    assert mysql.returncode == 2 and "OUTBOX_DATABASE_URL" in mysql.stderr
    assert unreachable.returncode == 1 and "OUTBOX_DATABASE_URL" in unreachable.stderr
    for r in (bad_lease, mysql, unreachable):
        assert "Traceback" not in r.stderr and r.stdout.strip() == "", r.stderr
    assert help_.returncode == 0 and "usage" in help_.stdout
    assert cli.ops() == before


JSONL_LINES = [
    '{"idempotency_key": "j1", "action": "payments.refund.create", "args": {"order_id": "o-1", "amount": 5.00}}',
    '{"idempotency_key": "j2", "action": "payments.refund.create", "args": {"order_id": "o-2"',  # malformed
    '{"action": "payments.refund.create", "args": {}}',  # missing idempotency_key
    '{"idempotency_key": "j3", "action": "a.b", "args": {}, "colour": "red"}',  # unknown field
    '{"idempotency_key": "j1", "action": "payments.refund.create", "args": {"order_id": "o-1", "amount": 6}}',  # conflict
    '{"idempotency_key": "j4", "action": "support.ticket.create", "args": {"subject": "hi"}, "tenant": "globex"}',
    '{"idempotency_key": "j1", "action": "payments.refund.create", "args": {"amount": 5, "order_id": "o-1"}}',  # replay
]


def _check_jsonl_output(r: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert r.returncode not in (0, 1), (r.returncode, r.stderr)  # some lines were bad: not a clean run
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["line"] for o in out] == list(range(1, len(JSONL_LINES) + 1))  # one answer per input line
    ok1, malformed, missing, unknown, conflict, ok4, replay = out
    assert ok1["new"] is True and "error" not in ok1
    assert malformed["error"] == "invalid" and malformed["field"] == "line"
    assert missing["error"] == "invalid" and missing["field"] == "idempotency_key"
    assert unknown["error"] == "invalid" and unknown["field"] == "colour"
    assert conflict["error"] == "idempotency_conflict" and conflict["operation_id"] == ok1["operation_id"]
    assert ok4["new"] is True and ok4["tenant"] == "globex"
    assert replay["new"] is False and replay["operation_id"] == ok1["operation_id"]
    return out


def test_submit_jsonl_from_a_file_and_from_stdin(cli: Cli, tmp_path: Path) -> None:
    assert cli("migrate").returncode == 0
    path = tmp_path / "intents.jsonl"
    path.write_text("\n".join(JSONL_LINES) + "\n")
    from_file = _check_jsonl_output(cli("submit", "--jsonl", str(path)))
    stored = cli.ops()
    assert {o["idempotency_key"] for o in stored} == {"j1", "j4"}  # good lines stored despite bad ones
    # The same batch again from stdin: every good line is now a replay of the same operation.
    r = cli("submit", "--jsonl", "-", stdin="\n".join(JSONL_LINES) + "\n")
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode not in (0, 1)
    assert len(out) == len(JSONL_LINES)
    assert out[0]["new"] is False and out[0]["operation_id"] == from_file[0]["operation_id"]
    assert out[5]["new"] is False and out[5]["operation_id"] == from_file[5]["operation_id"]
    assert [o.get("error") for o in out] == [o.get("error") for o in from_file]
    assert cli.ops() == stored


def test_demo_runs_on_the_embedded_default_in_an_empty_folder(tmp_path: Path) -> None:
    cli = Cli(tmp_path, _base_env(tmp_path))  # OUTBOX_DATABASE_URL unset: the embedded default
    demo = cli("demo", "--intents", "3")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert (tmp_path / "data" / "outbox.ledger.db").exists()


def test_demo_says_when_its_worker_dies_and_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pipeline process that ends early is named, with its exit code and its last lines; the demo
    fails; no figure goes negative. (The worker here is a real process that dies at once.)"""
    from workers.cli import main as cli_main
    from workers.cli import pipeline

    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("OUTBOX_ACTIONS_FILE", "set by the demo")  # restored after the test
    monkeypatch.setenv("COLUMNS", "200")
    dying = [sys.executable, "-c", "import sys; print('worker: cannot start (the test made it so)'); sys.exit(3)"]
    monkeypatch.setattr(pipeline, "worker_command", lambda *a, **kw: dying)

    code = cli_main.main(["demo", "--intents", "3", "--timeout-s", "20"])

    out = capsys.readouterr().out
    assert code == 1
    assert "the worker process ended (exit code 3) with 3 operation(s) not settled" in out
    assert "worker: cannot start (the test made it so)" in out
    kept = list((tmp_path / "data").glob("demo-*-worker.log"))
    assert len(kept) == 1 and "cannot start" in kept[0].read_text()
    [retries_row] = [line for line in out.splitlines() if "dispatch attempts / retries" in line]
    assert retries_row.strip(" │|").split()[-3:] == ["0", "/", "0"]


def test_run_stops_and_says_so_when_its_worker_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.cli import main as cli_main
    from workers.cli import pipeline

    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("OUTBOX_ACTIONS_FILE", str(Path(__file__).resolve().parents[3] / "examples" / "actions.yaml"))
    monkeypatch.setattr(pipeline, "worker_command", lambda *a, **kw: [sys.executable, "-c", "raise SystemExit(4)"])

    before = signal.getsignal(signal.SIGTERM)
    try:
        assert cli_main.main(["run"]) == 1
    finally:
        signal.signal(signal.SIGTERM, before)  # `run` installs its own; this process is pytest's
    assert "agent-outbox run: the worker process ended (exit code 4); stopping" in capsys.readouterr().err
