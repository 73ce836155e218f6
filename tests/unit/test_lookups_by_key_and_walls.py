"""Review of issue 50 (findings 2, 3, 4, 6, 10): one definition of "a lookup by our key" (its request
names ``{idempotency_key}``) for the loader, provider_fencing and interpret_lookup; HEAD lookups that say
what existence means; a not-found made of others' objects at a provider that does not honour keys; the
webhook endpoints' tenant walls; one parser of templates."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.actions import matching, specs
from outbox.actions.specs import LookupSpec
from outbox.ledger.states import AttemptClass, Status
from tests.unit.test_outcomes import T0, claim
from workers.provider.actions import ActionsFileError, load_actions, parse_actions
from workers.provider.lookups import LookupResult, interpret_lookup, verify_found
from workers.provider.targets import TargetConfig
from workers.reconcile.judge import MAX_LOOKUPS, after_not_found, judge
from workers.service.webhooks import EndpointNotFound, _endpoint

BY_CHARGE = {"method": "GET", "path": "/v1/refunds", "query": {"charge": "{charge}"}}
BY_KEY = {"method": "GET", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}}
KEY = "t1:our-key"
ARGS = {"charge": "ch_1", "amount": 500}


def _doc(**lookup: Any) -> dict[str, Any]:
    return {
        "targets": {"pay": {"base_url": "http://127.0.0.1:1"}},
        "actions": {
            "pay.refund.create": {
                "target": "pay",
                "request": {"method": "POST", "path": "/v1/refunds"},
                "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
                "args": ["charge", "amount"],
                "lookup": lookup,
            }
        },
    }


def _refused(tmp_path: Path, doc: dict[str, Any]) -> str:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ActionsFileError) as info:
        load_actions(path, environ={})
    return str(info.value)


def _answer(spec: LookupSpec, *objects: dict[str, Any]) -> LookupResult:
    return interpret_lookup(200, json.dumps({"data": list(objects)}).encode(), spec, "id", KEY, args=ARGS)


# --- 2 + 10(a): by key only when the request names the key --------------------------------------


def test_a_key_field_alone_does_not_make_a_lookup_by_reference_one_by_key(tmp_path: Path) -> None:
    message = _refused(tmp_path, _doc(request=BY_CHARGE, key_field="metadata.idempotency_key"))
    assert "actions.pay.refund.create.lookup:" in message and "key_field alone" in message
    assert "add lookup.match" in message
    assert not LookupSpec.model_validate({"request": BY_CHARGE, "match": {"amount": "{amount}"}}).by_key
    assert LookupSpec.model_validate({"request": BY_KEY, "key_field": "metadata.idempotency_key"}).by_key


def test_a_lookup_by_reference_adopts_only_an_object_that_carries_our_key_exactly() -> None:
    spec = LookupSpec.model_validate(
        {"request": BY_CHARGE, "key_field": "metadata.idempotency_key", "match": {"amount": "{amount}"}}
    )
    dashboard = {"id": "re_dash", "status": "succeeded", "amount": 500, "metadata": {}}  # same charge, same amount
    found = _answer(spec, dashboard)
    assert (found.outcome, found.provider_reference, found.others) == ("not_found", None, 1)
    other_key = dashboard | {"id": "re_other", "metadata": {"idempotency_key": "t1:another"}}
    ours = dashboard | {"id": "re_ours", "metadata": {"idempotency_key": KEY}}
    found = _answer(spec, dashboard, other_key, ours)
    assert (found.outcome, found.provider_reference) == ("found", "re_ours")
    # A Python hook's answer is held to the same rule.
    hooked = LookupResult("found", "hook", "succeeded", dashboard, "re_dash")
    assert verify_found(hooked, spec, ARGS, KEY).outcome == "not_found"
    # Asked by the key, the provider filtered: an object that does not echo the field is the key's.
    by_key = LookupSpec.model_validate({"request": BY_KEY, "key_field": "metadata.idempotency_key"})
    assert _answer(by_key, dashboard).outcome == "found"
    assert _answer(by_key, other_key).outcome == "not_found"


# --- 3: HEAD -------------------------------------------------------------------------------------


def test_a_head_lookup_must_ask_by_the_key(tmp_path: Path) -> None:
    head_by_order = {"method": "HEAD", "path": "/v1/orders/{charge}/refund"}
    message = _refused(tmp_path, _doc(request=head_by_order, key_field="metadata.key"))
    assert "a HEAD lookup has no body" in message and "{idempotency_key}" in message


def test_a_head_2xx_is_found_in_an_unknown_state_unless_existence_is_declared_to_mean_success(tmp_path: Path) -> None:
    head = {"method": "HEAD", "path": "/v1/refunds/by-key/{idempotency_key}"}
    plain = LookupSpec.model_validate({"request": head})
    found = interpret_lookup(200, b"", plain, "id", KEY, args=ARGS)
    assert (found.outcome, found.state) == ("found", "unknown")
    declared = LookupSpec.model_validate({"request": head, "exists_means": "succeeded"})
    assert interpret_lookup(204, b"", declared, "id", KEY, args=ARGS).state == "succeeded"
    assert interpret_lookup(404, b"", declared, "id", KEY, args=ARGS).outcome == "not_found"
    message = _refused(tmp_path, _doc(request=BY_KEY, exists_means="succeeded"))
    assert "exists_means applies to a HEAD lookup" in message
    # Found, state unknown: the provider has it; looked up again, never called succeeded.
    rc = claim(1, kind="lookup")
    verdict = judge(rc, _action(), found, now=T0, last_activity=T0, rng=random.Random(1))
    assert verdict.to is Status.ACCEPTED and verdict.recheck_in_s > 0


# --- 6: others' objects only, at a provider that does not honour keys ---------------------------


def _action(*, keys: bool = True) -> Any:
    doc = _doc(request=BY_CHARGE, match={"amount": "{amount}"}, authoritative_not_found=True, settle_s=0)
    if not keys:
        del doc["actions"]["pay.refund.create"]["provider_idempotency"]
    return parse_actions(copy.deepcopy(doc)).action("pay.refund.create")


def test_only_others_objects_without_provider_keys_is_no_proof_a_person_decides_never_a_resend() -> None:
    others_only = LookupResult("not_found", "found 1 object(s), none of them ours (match: amount differs)", others=1)
    rng = random.Random(1)
    # Nothing may still land (every earlier attempt proven absent): a not-found would send it again.
    rc = claim(1, kind="lookup", proven_absent_through=1)
    verdict = judge(rc, _action(keys=False), others_only, now=T0, last_activity=T0, rng=rng)
    assert verdict.to is Status.OUTCOME_UNKNOWN and verdict.recheck_in_s > 0
    assert "does not honour idempotency keys" in verdict.reason
    spent = judge(
        claim(MAX_LOOKUPS, kind="lookup"), _action(keys=False), others_only, now=T0, last_activity=T0, rng=rng
    )
    assert spent.to is Status.RECONCILIATION_REQUIRED
    # Where the provider honours the key, a re-send under it is deduplicated: the declared rule holds.
    with_keys = judge(rc, _action(), others_only, now=T0, last_activity=T0, rng=rng)
    assert with_keys.to is Status.NOT_DISPATCHED
    assert after_not_found(rc, _action(), with_keys, [], now=T0).to is Status.NOT_DISPATCHED
    # Finding nothing at all is still the declared not-found.
    nothing = LookupResult("not_found", "empty result")
    assert judge(rc, _action(keys=False), nothing, now=T0, last_activity=T0, rng=rng).klass is AttemptClass.NOT_SENT


# --- 10(b): one parser of templates --------------------------------------------------------------


def test_one_parser_of_templates() -> None:
    assert specs.placeholders is matching.placeholders
    assert not hasattr(matching, "template_arguments")
    assert matching.placeholders("/v1/{order}/x?{idempotency_key}") == {"order", "idempotency_key"}


# --- 4: the webhook endpoints' tenant walls ------------------------------------------------------

TARGET = {
    "base_url": "https://api.example.com",
    "headers": {"Authorization": "Bearer platform"},
    "tenants": {
        "acme": {"headers": {"Authorization": "Bearer acme-own-account"}},  # an account, no webhook secret
        "globex": {"headers": {"Authorization": "Bearer globex"}, "webhook_secret": "whsec_globex"},
        "small": {"rate_limit": {"per_s": 5}},  # no account of its own: the platform's
    },
    "webhooks": {"scheme": "stripe", "secret": "whsec_platform"},
}


def test_a_tenant_with_its_own_account_is_walled_off_the_targets_secret() -> None:
    cfg = TargetConfig.model_validate(TARGET)
    assert cfg.walled_tenants == ["acme", "globex"]  # the target's endpoint settles none of theirs
    assert _endpoint(cfg, "pay", None) == ("stripe", ["whsec_platform"], "")
    assert _endpoint(cfg, "pay", "globex") == ("stripe", ["whsec_globex"], "globex")
    assert _endpoint(cfg, "pay", "small") == ("stripe", ["whsec_platform"], "")  # the same secret's owner
    missing = []
    for target, tenant in [("pay", "acme"), ("pay", "no-such-tenant"), ("pay", "x" * 500)]:
        with pytest.raises(EndpointNotFound) as info:
            _endpoint(cfg, target, tenant)
        missing.append(info.value)
    with pytest.raises(EndpointNotFound) as unknown_target:
        _endpoint(None, "nowhere", "acme")
    missing.append(unknown_target.value)
    # One answer for every "no endpoint here": it tells nobody which tenants exist or have a secret.
    assert {str(e) for e in missing} == {EndpointNotFound.PUBLIC}
    assert "acme" in missing[0].why and "no-such-tenant" in missing[1].why  # for the log
