"""`agent-outbox probe ACTION` against the sandbox provider: a healthy provider passes every check,
making exactly the one effect the probe says; each way a provider can break a declaration is reported
by the check it breaks, with exit 1 and the actions-file setting to change; a live target is refused
before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REFUND_ARGS, action, actions_doc
from workers.cli.main import main

REFUND = "payments.refund.create"
ARGS = json.dumps(REFUND_ARGS)


def write(tmp_path: Path, sandbox: Any, *, test_mode: bool = True, **over: Any) -> str:
    doc = actions_doc(sandbox.url, actions={REFUND: action("/v1/refunds", decimal_args=["amount"], **over)})
    doc["targets"]["sandbox"]["test_mode"] = test_mode
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def probe(capsys: Any, path: str, *extra: str) -> tuple[int, dict[str, Any]]:
    code = main(["probe", REFUND, "--args", ARGS, "--actions", path, "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def test_a_healthy_provider_passes_every_check_with_one_effect(sandbox, tmp_path, capsys):
    sandbox.configure(strict_fencing=True)
    code, report = probe(capsys, write(tmp_path, sandbox, provider_fencing=True))
    assert code == 0 and report["ok"], report
    got = checks(report)
    assert {name: c["ok"] for name, c in got.items()} == {
        "same key replays the same result": True,
        "changed arguments under a used key are refused": True,
        "lookup finds the effect": True,
        "not found is authoritative": True,
        "older fencing token refused": True,
        "key retention": None,
    }
    assert report["probe_key"].startswith("probe-") and report["target"] == "sandbox"
    # Exactly the one effect the probe made, under its key; the older token made none.
    assert [e["idempotency_key"] for e in sandbox.effects()] == [report["probe_key"]]


@pytest.mark.parametrize(
    ("config", "over", "broken", "fix"),
    [
        ({"idempotency": False}, {}, "same key replays the same result", "provider_idempotency"),
        ({"params_check": False}, {}, "changed arguments under a used key are refused", "provider_key"),
        ({"index_lag_s": 2.0}, {}, "lookup finds the effect", "lookup.settle_s to at least"),
        (
            {"strict_fencing": False},
            {"provider_fencing": True},
            "older fencing token refused",
            "provider_fencing: false",
        ),
    ],
    ids=["ignores-keys", "accepts-changed-args", "lookup-lags-settle", "ignores-fencing"],
)
def test_each_broken_declaration_is_reported_with_the_setting_to_change(
    sandbox, tmp_path, capsys, config, over, broken, fix
):
    sandbox.configure(**config)
    code, report = probe(capsys, write(tmp_path, sandbox, **over))
    assert code == 1 and not report["ok"]
    got = checks(report)
    assert got[broken]["ok"] is False and fix in got[broken]["fix"], got[broken]
    # The first broken check is the cause (a provider that ignores keys also answers the changed call
    # and leaves several objects under one key for its lookup; the others break alone).
    failing = [n for n, c in got.items() if c["ok"] is False]
    assert failing[0] == broken and (len(failing) == 1 or config == {"idempotency": False}), failing


def test_a_not_found_that_is_not_authoritative_is_reported(sandbox, tmp_path, capsys):
    sandbox.add_fault(mode="unavailable_503", method="GET", key_pattern="probe-never-*")
    code, report = probe(capsys, write(tmp_path, sandbox))
    got = checks(report)
    assert code == 1 and got["not found is authoritative"]["ok"] is False
    assert "authoritative_not_found: false" in got["not found is authoritative"]["fix"]


def test_a_live_target_is_refused_before_anything_is_sent(sandbox, tmp_path, capsys):
    code = main(["probe", REFUND, "--args", ARGS, "--actions", write(tmp_path, sandbox, test_mode=False)])
    err = capsys.readouterr().err
    assert code == 2 and "test_mode: true" in err and "--allow-live" in err
    assert sandbox.requests() == []
    code = main(["probe", REFUND, "--args", "[1]", "--actions", write(tmp_path, sandbox)])
    assert code == 2 and "--args must be a JSON object" in capsys.readouterr().err


def test_the_table_says_what_held(sandbox, tmp_path, capsys):
    sandbox.configure(idempotency=False)
    code = main(["probe", REFUND, "--args", ARGS, "--actions", write(tmp_path, sandbox)])
    out = capsys.readouterr().out
    assert code == 1 and "BROKEN" in out and "a declaration is broken" in out
