"""Provider keys scoped by tenant, masking by path and by value, and their checks (issue 15)."""

from __future__ import annotations

import pytest

from outbox.ledger.provider_keys import DEFAULT_RULE, KeyRule, rule_for
from outbox.privacy.masking import MASK, Redactor, mask_paths, path_problem
from tests.unit.test_actions import ENV, mutated
from workers.provider.actions import ActionsFileError, parse_actions


def test_the_default_provider_key_is_scoped_by_tenant():
    a = DEFAULT_RULE.render(tenant="a", idempotency_key="refund-1", action="x")
    b = DEFAULT_RULE.render(tenant="b", idempotency_key="refund-1", action="x")
    assert (a, b) == ("a:refund-1", "b:refund-1")
    assert rule_for(None, "x") is DEFAULT_RULE and rule_for({}, "x") is DEFAULT_RULE


def test_a_key_over_the_providers_limit_becomes_a_stable_hash_still_per_tenant():
    rule = KeyRule("{tenant}/{action}/{idempotency_key}", max_length=40)
    long_key = "k" * 100
    a = rule.render(tenant="a", idempotency_key=long_key, action="refund")
    b = rule.render(tenant="b", idempotency_key=long_key, action="refund")
    assert a.startswith("h:") and len(a) == 40 and a != b
    assert a == rule.render(tenant="a", idempotency_key=long_key, action="refund")  # stable
    assert rule.render(tenant="a", idempotency_key="short", action="refund") == "a/refund/short"


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{tenant}", "must contain {idempotency_key}"),
        ("{tenant}:{idempotency_key}:{amount}", "unknown placeholder(s) ['amount']"),
        ("{tenant!r}:{idempotency_key}", "no format spec or conversion"),
        ("{tenant:{idempotency_key}", "malformed template"),
    ],
)
def test_bad_templates_are_refused(template: str, words: str):
    with pytest.raises(ValueError, match=None) as exc:
        KeyRule(template)
    assert words in str(exc.value)


def test_masking_by_dotted_path_reaches_nested_objects_and_lists():
    value = {
        "customer": {"email": "x@y", "name": "Ada"},
        "items": [{"card": "4000", "sku": "s"}, {"sku": "t"}],
        "token": {"nested": "whole"},
    }
    masked = mask_paths(value, ["customer.email", "items[].card", "token", "missing.path"])
    assert masked == {
        "customer": {"email": MASK, "name": "Ada"},
        "items": [{"card": MASK, "sku": "s"}, {"sku": "t"}],
        "token": MASK,
    }
    assert value["customer"]["email"] == "x@y"  # the input is left as it was
    assert path_problem("items[].card") is None and "segment" in (path_problem("a..b") or "")


def test_values_are_redacted_wherever_they_are_echoed():
    args = {"customer": {"email": "ada@example.com"}, "items": [{"card": "4000-1234"}], "pin": "12"}
    r = Redactor.of(args, ["customer.email", "items[].card", "pin"])
    assert r.text("invalid card 4000-1234 for ada@example.com") == f"invalid card {MASK} for {MASK}"
    assert r.json({"echo": ["ada@example.com"], "n": 12}) == {"echo": [MASK], "n": 12}  # "12": too short to hunt
    assert not Redactor.of(args, [])


def test_a_provider_key_without_tenant_needs_per_tenant_credentials():
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(mutated(provider_key="{idempotency_key}"), source="a.yaml", environ=ENV)
    assert "actions.payments.refund.create.provider_key" in str(exc.value) and "targets.payments.tenants" in str(
        exc.value
    )
    data = mutated(provider_key="{idempotency_key}")
    data["targets"]["payments"]["tenants"] = {"acme": {"headers": {"Authorization": "Bearer ${TOKEN}"}}}
    cfg = parse_actions(data, source="a.yaml", environ=ENV)
    assert cfg.key_rule("payments.refund.create") == KeyRule("{idempotency_key}")
    target = cfg.targets["payments"]
    assert target.headers_for("acme") == {"Authorization": "Bearer s3cret"} and target.headers_for("other") is None
    assert "s3cret" not in repr(target)


def test_sensitive_paths_are_checked_against_the_declared_arguments():
    ok = parse_actions(mutated(sensitive_args=["customer_email", "order_id.x"]), source="a.yaml", environ=ENV)
    assert ok.action("payments.refund.create").sensitive_args == ["customer_email", "order_id.x"]
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(mutated(sensitive_args=["customer.email"]), source="a.yaml", environ=ENV)
    assert "sensitive_args" in str(exc.value) and "['customer']" in str(exc.value)
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(mutated(sensitive_response_fields=["a..b"]), source="a.yaml", environ=ENV)
    assert "sensitive_response_fields" in str(exc.value)


def test_a_sensitive_argument_cannot_be_a_tool_calls_reference(tmp_path):
    """The key of a tool call is written out of its reference values, and keys are shown unmasked in
    every output (API, MCP, console, CLI) and sent to the provider: a sensitive reference would put
    the secret in all of them, so such an actions file is refused, naming both settings, by the
    workers' loader and by the producers' (the MCP server, the API), which make the keys."""
    import yaml

    from outbox.actions.rules import load_action_rules
    from producer.agents.calls import call_key

    secret = "ada@example.com"
    assert secret in call_key("chat-1", "payments.refund.create", {"customer_email": secret}, ("customer_email",))
    for sensitive in (["customer_email"], ["customer_email.address"]):
        data = mutated(sensitive_args=sensitive, tool={"reference_args": ["order_id", "customer_email"]})
        with pytest.raises(ActionsFileError) as exc:
            parse_actions(data, source="a.yaml", environ=ENV)
        path = tmp_path / "actions.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ActionsFileError) as producers:
            load_action_rules(path, environ=ENV)
        for refused in (exc.value, producers.value):
            assert "actions.payments.refund.create.tool.reference_args" in str(refused)
            assert "['customer_email'] are sensitive" in str(refused)
    ok = mutated(tool={"reference_args": ["order_id"]})
    assert parse_actions(ok, source="a.yaml", environ=ENV).action("payments.refund.create").tool.reference_args == [
        "order_id"
    ]
    path.write_text(yaml.safe_dump(ok))
    assert load_action_rules(path, environ=ENV).tools["payments.refund.create"].reference_args == ["order_id"]


def test_beat_purges_daily():
    from outbox.settings import Settings
    from workers.wiring.celery_app import PURGE_TASK, make_app

    entry = make_app(Settings()).conf.beat_schedule["purge"]
    assert entry["task"] == PURGE_TASK and entry["schedule"] == 86400.0


def test_a_tenant_name_cannot_forge_the_separator():
    a = DEFAULT_RULE.render(tenant="acme:eu", idempotency_key="r1", action="x")
    b = DEFAULT_RULE.render(tenant="acme", idempotency_key="eu:r1", action="x")
    assert a != b and (a, b) == ("acme%3Aeu:r1", "acme:eu:r1")
    assert DEFAULT_RULE.render(tenant="50%", idempotency_key="k", action="x") == "50%25:k"


def test_a_connector_hook_written_before_tenants_is_called_without_tenant():
    from workers.provider.connectors import _checked

    class Legacy:
        def send(self, name, cfg, *, args, idempotency_key, fencing_token):  # type: ignore[no-untyped-def]
            return ("sent", idempotency_key)

        def lookup(self, name, cfg, *, args, idempotency_key, fencing_token=None):  # type: ignore[no-untyped-def]
            return ("looked", idempotency_key)

        def close(self) -> None:
            pass

    hook = _checked("a", Legacy())  # type: ignore[arg-type]
    assert hook.send("a", None, args={}, idempotency_key="k", fencing_token=1, tenant="t") == ("sent", "k")  # type: ignore[arg-type]
    assert hook.lookup("a", None, args={}, idempotency_key="k", fencing_token=1, tenant="t") == ("looked", "k")  # type: ignore[arg-type]


def test_a_producer_reads_its_rules_without_the_targets_secrets(tmp_path):
    import yaml

    from outbox.actions.rules import load_action_rules
    from tests.unit.test_actions import BASE

    doc = mutated(provider_key="{tenant}/{idempotency_key}", approval={"required": "always", "ttl_s": 60})
    assert "${TOKEN}" in str(BASE["targets"])  # a target secret the producer's environment lacks
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    rules = load_action_rules(path, environ={})
    assert rules.key_rule("payments.refund.create") == KeyRule("{tenant}/{idempotency_key}")
    assert rules.needs_approval("payments.refund.create", {}) and rules.key_rule("nope") is None
