"""An action's version (outbox/actions/versions.py): the same for the same request-shaping definition
however the file spells it, another one when any part that shapes the request changes, the same
when credentials change; and the producer (part of the file) and the workers (all of it) agree."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.actions.rules import load_action_rules
from workers.provider.actions import load_actions, parse_actions

BASE: dict[str, Any] = {
    "targets": {
        "payments": {
            "base_url": "https://pay.example.com/api",
            "timeout_s": 5,
            "headers": {"Authorization": "Bearer ${PAY_TOKEN}"},
        },
        "other": {"base_url": "https://other.example.com"},
    },
    "actions": {
        "payouts.create": {
            "target": "payments",
            "request": {"method": "POST", "path": "/v1/payouts/{account}", "query": {"mode": "live"}},
            "args": ["account", "amount_cents", "currency"],
            "decimal_args": ["amount_cents"],
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
            "fencing_header": "X-Fencing-Token",
            "budget": {"max_attempts": 3},
        }
    },
}
ENV = {"PAY_TOKEN": "secret-1"}


def version(doc: dict[str, Any], env: dict[str, str] | None = None) -> str | None:
    return parse_actions(doc, environ=env or ENV).action_version("payouts.create")


def changed(path: str, value: Any) -> dict[str, Any]:
    """BASE with ``path`` ("actions.<field>" of the one action, "targets.<field>" of payments) set to
    ``value`` (None: removed)."""
    doc = copy.deepcopy(BASE)
    section, last = path.split(".")
    node = doc["actions"]["payouts.create"] if section == "actions" else doc["targets"]["payments"]
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return doc


def test_the_version_is_a_short_hex_digest_and_stable() -> None:
    v = version(BASE)
    assert v is not None and len(v) == 16 and int(v, 16) >= 0
    assert version(copy.deepcopy(BASE)) == v


def test_key_order_spelling_and_whitespace_of_the_yaml_change_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(BASE, sort_keys=False))
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text(
        """
actions:
  payouts.create:
    budget: {max_attempts: 3}
    decimal_args: [amount_cents]
    provider_idempotency:   {retention_s: 86400.0, header: idempotency-key}
    request:
        query:   {mode: "live"}
        path: "/v1/payouts/{account}"
        method: post
    args: [currency, amount_cents, account]
    fencing_header: X-Fencing-Token
    target: payments
targets:
  other: {base_url: "https://other.example.com"}
  payments:
    headers: {Authorization: "Bearer ${PAY_TOKEN}"}
    base_url: https://pay.example.com/api/
    timeout_s: 5
"""
    )
    versions = {load_actions(path, environ=ENV).action_version("payouts.create") for path in (plain, reordered)} | {
        load_action_rules(path, environ=ENV).action_version("payouts.create") for path in (plain, reordered)
    }
    assert versions == {version(BASE)}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("actions.target", "other"),
        ("targets.base_url", "https://pay.example.com/api/v2"),
        ("actions.request", {"method": "PUT", "path": "/v1/payouts/{account}", "query": {"mode": "live"}}),
        ("actions.request", {"method": "POST", "path": "/v2/payouts/{account}", "query": {"mode": "live"}}),
        ("actions.request", {"method": "POST", "path": "/v1/payouts/{account}"}),
        ("actions.request", {"method": "POST", "path": "/v1/payouts/{account}", "query": {"mode": "x"}}),
        ("actions.decimal_args", None),
        ("actions.decimal_args", ["amount_cents", "currency"]),
        ("actions.provider_idempotency", {"header": "X-Request-Key", "retention_s": 86400}),
        ("actions.provider_idempotency", None),
        ("actions.connector", "tests.unit.test_action_versions:factory"),
    ],
    ids=[
        "target",
        "base_url",
        "method",
        "path",
        "query-removed",
        "query-value",
        "decimal_args-removed",
        "decimal_args-added",
        "idempotency-header",
        "no-provider-keys",
        "connector",
    ],
)
def test_every_part_that_shapes_the_request_changes_the_version(path: str, value: Any) -> None:
    doc = changed(path, value)
    if path == "actions.target":
        doc["targets"]["other"]["base_url"] = BASE["targets"]["payments"]["base_url"]  # the name alone
    assert version(doc) != version(BASE)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("targets.headers", {"Authorization": "Bearer ${PAY_TOKEN}", "X-Extra": "1"}),
        ("targets.tenants", {"t1": {"headers": {"Authorization": "Bearer t1"}}}),
        ("targets.timeout_s", 30),
        ("actions.fencing_header", None),
        ("actions.budget", {"max_attempts": 9}),
        ("actions.provider_idempotency", {"header": "Idempotency-Key", "retention_s": 3600}),
        ("actions.provider_key", "{tenant}/{idempotency_key}"),
        ("actions.sensitive_args", ["account"]),
    ],
    ids=[
        "headers",
        "tenant-credentials",
        "timeout",
        "fencing-header",
        "budget",
        "retention",
        "provider-key",
        "masking",
    ],
)
def test_credentials_and_what_does_not_shape_the_request_leave_the_version(path: str, value: Any) -> None:
    assert version(changed(path, value)) == version(BASE)


def test_a_rotated_secret_leaves_the_version() -> None:
    assert version(BASE, {"PAY_TOKEN": "secret-2"}) == version(BASE, {"PAY_TOKEN": "secret-1"})


def test_the_producer_without_a_workers_variable_records_no_version(tmp_path: Path) -> None:
    """A ``${VAR}`` in what the version reads, unset where the producer runs: no version (its first
    request records one); set: the workers' version. The targets' secrets are never needed."""
    doc = changed("targets.base_url", "${PAY_URL}")
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert load_action_rules(path, environ={}).action_version("payouts.create") is None
    env = {"PAY_URL": "https://pay.example.com/api"}
    assert load_action_rules(path, environ=env).action_version("payouts.create") == version(BASE)
    assert load_actions(path, environ=env | ENV).action_version("payouts.create") == version(BASE)


def test_an_action_not_in_the_file_has_no_version() -> None:
    assert parse_actions(BASE, environ=ENV).action_version("payouts.cancel") is None


def factory(config: Any) -> Any:  # a connector: reference for the version test (never called)
    raise AssertionError("not called")
