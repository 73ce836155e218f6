"""`agent-outbox probe ACTION` against the sandbox: a healthy provider passes every check with exactly
the effects the probe reports; each contract fault mode (workers/sandbox/faults.py) is reported by
its check, exit 1, with the setting to change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.cli.main import main
from workers.sandbox.scenario import action
from workers.sandbox.scenario import actions_doc as sandbox_actions

ARGS = {"order_id": "ord_probe", "amount": "1.00", "currency": "EUR"}
CHECKS = [
    "same key replays the same result",
    "changed arguments under one key are refused",
    "a lookup finds a created effect",
    '"not found" is authoritative',
    "fencing: a newer token refuses an older one",
    "key retention",
]


def actions_doc(url: str, *, test_mode: bool = True, settle_s: float = 1.0, fencing: bool = True) -> dict[str, Any]:
    """The sandbox as the one target (``test_mode`` as given) and its refund action as "refund"."""
    refund = action(
        "/v1/refunds",
        settle_s=settle_s,
        args=["order_id", "amount", "currency"],
        decimal_args=["amount"],
        provider_fencing=fencing,
    )
    doc = sandbox_actions(url, timeout_s=5, actions={"refund": refund})
    if test_mode:
        doc["targets"]["sandbox"]["test_mode"] = True
    return doc


def probe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, *extra: str, **doc: Any
) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc(url, **doc)))
    code = main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS), "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def test_a_healthy_sandbox_passes_every_check_with_exactly_the_effects_it_reports(sandbox, tmp_path, capsys):
    sandbox.configure(strict_fencing=True)
    code, report = probe(tmp_path, capsys, sandbox.url)
    assert code == 0, report
    assert report["ok"] is True and report["action"] == "refund" and report["target"] == "sandbox"
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert set(report) == {"action", "target", "ok", "checks", "keys", "effects"}
    for check in report["checks"]:
        assert set(check) == {"name", "declared", "observed", "ok", "verdict", "fix"}
        assert check["ok"] in (True, None) and check["fix"] is None
    assert by_name(report)["key retention"]["observed"].startswith("not checked: the provider does not expose it")
    effects = sandbox.effects()
    assert len(effects) == 1 == len(report["effects"])  # the replayed create: one effect, the one reported
    assert [e["object_id"] for e in effects] == report["effects"]
    assert all(e["idempotency_key"].startswith("probe-") for e in effects)
    assert all(k.startswith("probe-") for k in report["keys"])


@pytest.mark.parametrize(
    "rule,check,fix",
    [
        ({"mode": "ignore_idempotency_key", "method": "POST"}, CHECKS[0], "provider_idempotency"),
        ({"mode": "accept_changed_args", "method": "POST"}, CHECKS[1], "provider_idempotency"),
        ({"mode": "lookup_never_finds", "method": "GET"}, CHECKS[2], "lookup.request"),
        ({"mode": "lookup_lag", "method": "GET", "lag_s": 2.0}, CHECKS[2], "lookup.settle_s"),
        ({"mode": "ignore_fencing"}, CHECKS[4], "provider_fencing: false"),
    ],
)
def test_each_broken_sandbox_mode_is_reported_by_its_check(sandbox, tmp_path, capsys, rule, check, fix):
    sandbox.configure(strict_fencing=True)
    sandbox.add_fault(path="/v1/refunds", **rule)
    code, report = probe(tmp_path, capsys, sandbox.url)
    assert code == 1 and report["ok"] is False
    broken = by_name(report)[check]
    assert broken["ok"] is False and broken["verdict"] == "BROKEN"
    assert broken["fix"].startswith(fix), broken
    if rule["mode"] == "ignore_idempotency_key":  # two objects under one key: the lookup's answer says so too
        assert by_name(report)[CHECKS[2]]["fix"].startswith("provider_idempotency")
        assert len(report["effects"]) == 3  # the create, its replay, the changed arguments: one effect each
    if rule["mode"] == "lookup_lag":  # found, only late: its "not found" still holds once settle_s is right
        assert by_name(report)[CHECKS[3]]["ok"] is True
    if rule["mode"] == "lookup_never_finds":  # then its "not found" proves nothing either
        assert by_name(report)[CHECKS[3]]["fix"].startswith("lookup.authoritative_not_found: false")
    # The probe still says every effect it made (a provider that ignores keys makes more).
    assert sorted(e["object_id"] for e in sandbox.effects()) == sorted(report["effects"])


def test_a_provider_that_does_not_fence_breaks_the_declaration(sandbox, tmp_path, capsys):
    code, report = probe(tmp_path, capsys, sandbox.url)  # strict_fencing off: the sandbox ignores tokens
    assert code == 1
    assert by_name(report)[CHECKS[4]]["fix"].startswith("provider_fencing: false")
    code, report = probe(tmp_path, capsys, sandbox.url, fencing=False)
    assert code == 0 and by_name(report)[CHECKS[4]]["verdict"] == "not checked"


def test_a_target_not_declared_a_test_mode_is_never_probed(sandbox, tmp_path, capsys):
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc(sandbox.url, test_mode=False)))
    code = main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS)])
    assert code == 2
    assert "test_mode: true" in capsys.readouterr().err
    assert sandbox.requests() == [] and sandbox.effects() == []


def test_missing_arguments_are_a_usage_error(sandbox, tmp_path, capsys):
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc(sandbox.url)))
    assert main(["probe", "refund", "--actions", str(path), "--args", "[1]"]) == 2
    assert main(["probe", "nope", "--actions", str(path)]) == 2
    assert sandbox.effects() == []


def test_the_table_names_each_check_and_the_setting_to_change(sandbox, tmp_path, capsys):
    sandbox.add_fault(path="/v1/refunds", mode="lookup_never_finds", method="GET")
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc(sandbox.url, fencing=False)))
    code = main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS)])
    out = capsys.readouterr().out
    assert code == 1
    for text in ("CHECK", "SETTING TO CHANGE", "BROKEN", "lookup.request", "effects made: 1"):
        assert text in out, out


def test_arguments_the_provider_refuses_are_a_usage_error_and_an_outage_a_failure(sandbox, tmp_path, capsys):
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(actions_doc(sandbox.url)))
    bad = json.dumps({**ARGS, "currency": "nope"})
    assert main(["probe", "refund", "--actions", str(path), "--args", bad]) == 2
    assert "--args" in capsys.readouterr().err
    sandbox.add_fault(mode="unavailable_503", path="/v1/refunds", method="POST")
    assert main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS)]) == 1
    assert "nothing to conclude" in capsys.readouterr().err
    assert sandbox.effects() == []


def test_the_tenant_s_own_credentials_are_used(sandbox, tmp_path, capsys):
    doc = actions_doc(sandbox.url, fencing=False)
    doc["targets"]["sandbox"]["tenants"] = {"acme": {"headers": {"Authorization": "Bearer acme"}}}
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS), "--tenant", "acme", "--json"])
    assert code == 0, capsys.readouterr()
    assert [e["tenant"] for e in sandbox.effects()] == ["acme"]
