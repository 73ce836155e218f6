"""`agent-outbox probe` on a lookup by business reference (lookup.match): the probe's own effect is
found as its intent's, and an intent whose compared argument differs is not handed it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.reconcile.test_probe import ARGS, by_name
from workers.cli.main import main
from workers.sandbox.scenario import action
from workers.sandbox.scenario import actions_doc as sandbox_actions

FOUND, NOT_FOUND = "a lookup finds a created effect", '"not found" is authoritative'


def probe(tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, currency: Any) -> tuple[int, dict[str, Any]]:
    lookup = {
        "request": {"method": "GET", "path": "/v1/refunds", "query": {"order_id": "{order_id}"}},
        "items": "data",
        "match": {"order_id": "{order_id}", "amount": "{amount}", "currency": currency},
        "authoritative_not_found": True,
        "settle_s": 1.0,
        "succeeded": ["succeeded"],
    }
    refund = action("/v1/refunds", lookup=lookup, args=["order_id", "amount", "currency"], decimal_args=["amount"])
    doc = sandbox_actions(url, timeout_s=5, actions={"refund": refund})
    doc["targets"]["sandbox"]["test_mode"] = True
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = main(["probe", "refund", "--actions", str(path), "--args", json.dumps(ARGS), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_lookup_by_order_finds_its_own_effect_and_refuses_another_intents(sandbox, tmp_path, capsys):
    code, report = probe(tmp_path, capsys, sandbox.url, {"equals": "{currency}", "compare": "casefold"})
    assert code == 0, report
    checks = by_name(report)
    assert checks[FOUND]["ok"] is True and checks[FOUND]["observed"].startswith(f"found {report['effects'][0]}")
    # Asked for the same order with another amount, the lookup answers the probe's refund: not ours.
    assert checks[NOT_FOUND]["ok"] is True and "an intent whose amount differs" in checks[NOT_FOUND]["observed"]
    assert len(sandbox.effects()) == 1 == len(report["effects"])


def test_a_match_the_provider_never_satisfies_names_lookup_match(sandbox, tmp_path, capsys):
    code, report = probe(tmp_path, capsys, sandbox.url, "{currency}")  # the sandbox writes "eur" for "EUR"
    assert code == 1
    broken = by_name(report)[FOUND]
    assert broken["verdict"] == "BROKEN" and broken["fix"].startswith("lookup.match:"), broken
    assert "none of them ours" in broken["observed"] and "currency differs" in broken["observed"]
