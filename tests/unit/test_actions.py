"""The actions file: the example loads; every kind of mistake names the file and the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.errors import ConfigError, OutboxError
from outbox.ledger.states import AttemptClass
from workers.provider.actions import ActionsFileError, UnknownAction, load_actions, load_actions_from_env, parse_actions

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "actions.yaml"

BASE: dict[str, Any] = {
    "targets": {"payments": {"base_url": "http://127.0.0.1:8900", "headers": {"Authorization": "Bearer ${TOKEN}"}}},
    "actions": {
        "payments.refund.create": {
            "target": "payments",
            "request": {"method": "POST", "path": "/v1/orders/{order_id}/refunds"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
            "args": ["order_id", "amount", "customer_email"],
            "decimal_args": ["amount"],
            "sensitive_args": ["customer_email"],
        }
    },
}
ENV = {"TOKEN": "s3cret"}


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def mutated(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["actions"]["payments.refund.create"].update(changes)
    return data


def error_for(tmp_path: Path, data: Any, environ: dict[str, str] = ENV) -> ActionsFileError:
    path = write(tmp_path, data)
    with pytest.raises(ActionsFileError) as info:
        load_actions(path, environ=environ)
    assert str(path) in str(info.value)
    return info.value


def test_example_file_loads_with_defaults() -> None:
    cfg = load_actions(EXAMPLE, environ={})
    refund = cfg.action("payments.refund.create")
    assert cfg.target_of("payments.refund.create").base_url == "http://127.0.0.1:8900"
    assert cfg.target_of(refund).headers["Authorization"] == "Bearer sandbox-token"
    assert refund.decimal_args == ["amount"] and refund.sensitive_args == ["customer_email"]
    assert refund.lookup is not None and refund.lookup.authoritative_not_found
    assert refund.listing is not None and refund.listing.items_field == "data"
    assert set(cfg.actions) == {
        "payments.refund.create",
        "payments.partial_refund.create",
        "support.ticket.create",
        "notify.email.send",
    }
    email = cfg.action("notify.email.send")
    assert email.on_ambiguous == "lookup" and email.result_reference == "id"


def test_defaults(tmp_path: Path) -> None:
    cfg = load_actions(write(tmp_path, BASE), environ=ENV)
    target = cfg.targets["payments"]
    assert (target.timeout_s, target.connect_timeout_s) == (10, 2)
    action = cfg.action("payments.refund.create")
    assert action.on_ambiguous == "lookup"
    assert action.budget.model_dump() == {"max_attempts": 5, "deadline_s": 3600, "base_delay_s": 0.5, "max_delay_s": 60}


def test_env_resolution_and_secret_not_in_repr(tmp_path: Path) -> None:
    cfg = load_actions(write(tmp_path, BASE), environ=ENV)
    assert cfg.targets["payments"].headers == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(cfg)


def test_missing_env_var_is_named(tmp_path: Path) -> None:
    err = error_for(tmp_path, BASE, environ={})
    assert "TOKEN" in str(err)
    assert err.problems[0][0] == "targets.payments.headers.Authorization"


def test_env_default(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["targets"]["payments"]["base_url"] = "${PAY_URL:-http://localhost:1}"
    cfg = load_actions(write(tmp_path, data), environ=ENV)
    assert cfg.targets["payments"].base_url == "http://localhost:1"


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (mutated(budget={"max_attempts": 0}), "actions.payments.refund.create.budget.max_attempts", "greater than 0"),
        (mutated(budget={"base_delay_s": 70}), "actions.payments.refund.create.budget", "base_delay_s"),
        (mutated(on_ambiguous="replay", provider_idempotency=None), "actions.payments.refund.create", "replay"),
        (mutated(on_ambigous="lookup"), "actions.payments.refund.create.on_ambigous", "Extra inputs"),
        (mutated(on_ambiguous="retry"), "actions.payments.refund.create.on_ambiguous", "lookup"),
        (mutated(target="payment"), "actions.payments.refund.create.target", "unknown target 'payment'"),
        (
            mutated(request={"method": "POST", "path": "/v1/orders/{oder_id}"}),
            "actions.payments.refund.create.request.path",
            "oder_id",
        ),
        (
            mutated(request={"method": "POST", "path": "v1/refunds"}),
            "actions.payments.refund.create.request.path",
            "'/'",
        ),
        (mutated(request={"method": "FETCH", "path": "/v1"}), "actions.payments.refund.create.request.method", "POST"),
        (mutated(decimal_args=["amont"]), "actions.payments.refund.create.decimal_args", "amont"),
        (mutated(status_map={"600": "ambiguous"}), "actions.payments.refund.create.status_map", "status code"),
        (mutated(status_map={409: "not_sent"}), "actions.payments.refund.create.status_map", "not_sent"),
        (
            mutated(list={"request": {"method": "GET", "path": "/v1"}, "cursor_param": "after"}),
            "actions.payments.refund.create.list",
            "cursor",
        ),
    ],
)
def test_bad_fields_name_their_dotted_path(tmp_path: Path, data: Any, field: str, words: str) -> None:
    err = error_for(tmp_path, data)
    assert any(f == field and words in msg for f, msg in err.problems), err.problems
    assert f"{field}: " in str(err)


def test_target_timeouts_must_be_positive(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["targets"]["payments"].update(timeout_s=0, connect_timeout_s=-1)
    fields = {f for f, _ in error_for(tmp_path, data).problems}
    assert fields == {"targets.payments.timeout_s", "targets.payments.connect_timeout_s"}


def test_placeholders_without_declared_args_are_refused(tmp_path: Path) -> None:
    data = mutated(args=None, decimal_args=[], sensitive_args=[])
    err = error_for(tmp_path, data)
    assert "args" in str(err) and "actions.payments.refund.create.request" in str(err)


def test_lookup_may_use_idempotency_key_placeholder(tmp_path: Path) -> None:
    lookup = {"request": {"method": "GET", "path": "/v1/refunds", "query": {"k": "{idempotency_key}"}}}
    cfg = load_actions(write(tmp_path, mutated(lookup=lookup)), environ=ENV)
    assert cfg.action("payments.refund.create").lookup is not None


def test_status_map_keys_normalised(tmp_path: Path) -> None:
    cfg = load_actions(write(tmp_path, mutated(status_map={"409": "ambiguous", "5XX": "ambiguous"})), environ=ENV)
    assert cfg.action("payments.refund.create").status_map == {
        409: AttemptClass.AMBIGUOUS,
        "5xx": AttemptClass.AMBIGUOUS,
    }


def test_unknown_action_lists_known() -> None:
    cfg = load_actions(EXAMPLE, environ={})
    with pytest.raises(UnknownAction) as info:
        cfg.action("payments.refund.craete")
    assert isinstance(info.value, KeyError) and isinstance(info.value, OutboxError)
    assert "payments.refund.create" in str(info.value)


def test_unreadable_and_non_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(ActionsFileError, match="cannot read"):
        load_actions(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets: [unclosed")
    with pytest.raises(ActionsFileError, match="not valid YAML"):
        load_actions(bad)
    with pytest.raises(ActionsFileError, match="mapping"):
        parse_actions(["a"], source="x.yaml")


def test_load_from_env() -> None:
    assert load_actions_from_env({"OUTBOX_ACTIONS_FILE": str(EXAMPLE)}).actions
    with pytest.raises(ConfigError, match="OUTBOX_ACTIONS_FILE"):
        load_actions_from_env({})


def test_authoritative_lookup_by_a_key_that_is_never_sent_is_refused():
    # Found by a reconcile test: the provider never saw the key, so its 404 proved nothing and
    # the re-dispatch made a second refund.
    from workers.provider.actions import ActionsFileError, parse_actions

    doc = {
        "targets": {"p": {"base_url": "http://127.0.0.1:1"}},
        "actions": {
            "a": {
                "target": "p",
                "request": {"method": "POST", "path": "/r"},
                "lookup": {
                    "request": {"method": "GET", "path": "/r", "query": {"idempotency_key": "{idempotency_key}"}},
                    "authoritative_not_found": True,
                },
            }
        },
    }
    with pytest.raises(ActionsFileError, match="authoritative_not_found"):
        parse_actions(doc)
    doc["actions"]["a"]["lookup"]["authoritative_not_found"] = False
    parse_actions(doc)


def test_provider_fencing_needs_the_header_that_carries_the_token(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["actions"]["payments.refund.create"]["provider_fencing"] = True
    err = error_for(tmp_path, data)
    assert "provider_fencing" in str(err) and "fencing_header" in str(err)
    data["actions"]["payments.refund.create"]["fencing_header"] = "X-Fencing-Token"
    assert load_actions(write(tmp_path, data), environ=ENV).action("payments.refund.create").provider_fencing
    # Undeclared, a provider is assumed not to fence (the safe assumption).
    assert not load_actions(EXAMPLE, environ=ENV).action("payments.refund.create").provider_fencing
