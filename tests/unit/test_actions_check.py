"""`agent-outbox actions check FILE`: every problem of an actions file at once, each with its dotted
path, offline; unset ${VAR}s are notes unless --strict. The loader reports the same problems."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.cli.main import main
from workers.provider.actions import ActionsFileError, load_actions, parse_actions

ROOT = Path(__file__).resolve().parents[2]
REFUND = "payments.refund.create"
GOOD: dict[str, Any] = {
    "targets": {
        "payments": {"base_url": "${PAYMENTS_URL}", "headers": {"Authorization": "Bearer ${PAYMENTS_TOKEN}"}},
        "support": {"base_url": "http://127.0.0.1:8900"},
    },
    "actions": {
        REFUND: {
            "target": "payments",
            "request": {"method": "POST", "path": "/v1/orders/{order_id}/refunds"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
            "args": ["order_id", "amount"],
            "decimal_args": ["amount"],
        },
        "support.ticket.create": {"target": "support", "request": {"method": "POST", "path": "/v1/tickets"}},
    },
}
SET = {"PAYMENTS_URL": "https://payments.example.com", "PAYMENTS_TOKEN": "s3cret"}


def write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def broken() -> dict[str, Any]:
    """Four mistakes in three places: a budget, an unknown field, a placeholder, an unknown target."""
    doc = copy.deepcopy(GOOD)
    refund = doc["actions"][REFUND]
    refund["budget"] = {"max_attempts": 0}
    refund["retries"] = 3
    refund["request"]["path"] = "/v1/orders/{order}/refunds"
    doc["actions"]["support.ticket.create"]["target"] = "helpdesk"
    return doc


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["actions", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SET, "OUTBOX_SOFT_TIME_LIMIT_S", "OUTBOX_ARGS_RETENTION_S"):
        monkeypatch.delenv(name, raising=False)


def test_a_clean_file_is_one_line_and_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(capsys, str(ROOT / "examples" / "actions.yaml"))
    assert code == 0, out + err
    assert out.splitlines() == [f"{ROOT / 'examples' / 'actions.yaml'}: ok (4 actions, 3 targets)"]


def test_every_problem_is_reported_with_its_dotted_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(capsys, str(write(tmp_path, broken())))
    assert code == 1
    lines = out.splitlines()
    assert f"actions.{REFUND}.budget.max_attempts: Input should be greater than 0" in lines
    assert f"actions.{REFUND}.retries: Extra inputs are not permitted" in lines
    # The checks across fields run for the parts that are valid on their own, beside the others' errors.
    assert any(line.startswith("actions.support.ticket.create.target: unknown target 'helpdesk'") for line in lines)
    assert len(lines) == 3, lines  # the invalid refund's placeholders are not guessed at


def test_the_loader_collects_every_problem_too(tmp_path: Path) -> None:
    doc = broken()
    del doc["actions"][REFUND]["retries"]
    doc["actions"][REFUND]["budget"] = {"max_attempts": 2}
    with pytest.raises(ActionsFileError) as info:
        parse_actions(doc, environ=SET)
    fields = [field for field, _ in info.value.problems]
    assert fields == [f"actions.{REFUND}.request.path", "actions.support.ticket.create.target"]
    assert "placeholder(s) ['order'] are not argument names" in str(info.value)


def test_an_unset_variable_is_a_note_unless_strict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(write(tmp_path, GOOD))
    code, out, err = check(capsys, path)
    assert code == 0 and out.strip() == f"{path}: ok (2 actions, 2 targets)"
    assert "note: targets.payments.base_url: ${PAYMENTS_URL} is not set here; this value was not checked" in err
    assert "note: targets.payments.headers.Authorization: ${PAYMENTS_TOKEN} is not set here" in err

    code, out, _ = check(capsys, path, "--strict")
    assert code == 1
    assert out.splitlines() == [
        "targets.payments.base_url: environment variable PAYMENTS_URL is not set",
        "targets.payments.headers.Authorization: environment variable PAYMENTS_TOKEN is not set",
    ]


def test_json_names_every_problem_and_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = check(capsys, str(write(tmp_path, broken())), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and (doc["actions"], doc["targets"]) == (2, 2)
    assert {"path": f"actions.{REFUND}.budget.max_attempts", "message": "Input should be greater than 0"} in doc[
        "problems"
    ]
    assert [n["variable"] for n in doc["notes"]] == ["PAYMENTS_URL", "PAYMENTS_TOKEN"]


def test_what_workers_refuse_at_start_up_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = copy.deepcopy(GOOD)
    doc["targets"]["support"]["timeout_s"] = 40  # longer than the default soft time limit (30 s)
    code, out, _ = check(capsys, str(write(tmp_path, doc)))
    assert code == 1
    assert "workers would refuse to start: a target's timeout_s + connect_timeout_s (42s)" in out
    monkeypatch.setenv("OUTBOX_SOFT_TIME_LIMIT_S", "43")
    monkeypatch.setenv("OUTBOX_TIME_LIMIT_S", "50")
    assert check(capsys, str(write(tmp_path, doc)))[0] == 0


@pytest.mark.parametrize(
    ("text", "says"),
    [("targets: [unclosed", "not valid YAML"), ("- a list", "must be a mapping"), (None, "cannot read the file")],
)
def test_a_file_that_is_not_an_actions_file_is_one_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, says: str
) -> None:
    path = tmp_path / "actions.yaml"
    if text is not None:
        path.write_text(text)
    code, out, _ = check(capsys, str(path))
    assert code == 1 and says in out


def test_help_says_what_an_unset_variable_is(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["actions", "check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "is a note, not an error" in text and "--strict" in text


def test_a_key_declared_twice_is_a_problem_not_a_silent_replacement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = yaml.safe_dump(GOOD, sort_keys=False)
    twice = text + "  support.ticket.create: {target: support, request: {method: POST, path: /v1/other}}\n"
    path = tmp_path / "actions.yaml"
    path.write_text(twice)
    code, out, _ = check(capsys, str(path))
    assert code == 1
    assert out.splitlines()[0].startswith("actions.support.ticket.create: declared twice (lines ")
    with pytest.raises(ActionsFileError, match="declared twice"):
        load_actions(path, environ=SET)


def test_a_target_left_unchecked_for_an_unset_variable_still_has_its_actions_keys_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target's base_url is a ${VAR} not set where the file is checked: the target is left out
    of the cross checks, and an action's provider_key without {tenant} passed as "ok" although
    workers refuse the file at start."""
    doc = copy.deepcopy(GOOD)
    doc["actions"][REFUND]["provider_key"] = "{idempotency_key}"
    code, out, _ = check(capsys, str(write(tmp_path, doc)))
    assert code == 1
    assert out.splitlines()[0].startswith(f"actions.{REFUND}.provider_key: '{{idempotency_key}}' has no {{tenant}}")
    doc["targets"]["payments"]["tenants"] = {"acme": {"headers": {"Authorization": "Bearer ${ACME_TOKEN}"}}}
    code, out, _ = check(capsys, str(write(tmp_path, doc)))
    assert code == 0, out
