"""Webhook signatures (workers/webhooks/signatures.py) checked against independent signers: the
sandbox's own (workers/sandbox/webhooks.py), the ``standardwebhooks`` package's, and Stripe's rule
written out by hand; and the actions file's ``webhooks`` blocks, whose every mistake names its path."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from standardwebhooks.webhooks import Webhook

from workers.provider.actions import ActionsFileError, load_actions
from workers.sandbox.webhooks import sign_standard, sign_stripe, signed_headers
from workers.webhooks.events import readings
from workers.webhooks.signatures import TOLERANCE_S, WebhookRefused, verify

STANDARD = "whsec_" + base64.b64encode(b"0123456789abcdef01234567").decode()
OTHER = "whsec_" + base64.b64encode(b"another-secret-of-24-byt").decode()
STRIPE = "whsec_test_stripe_endpoint_secret"
NOW = 1_780_000_000  # a fixed time: verify() judges staleness by its now_s alone, never the wall clock
BODY = json.dumps({"id": "evt_1", "type": "refund.succeeded", "data": {"object": {"id": "re_1"}}}).encode()


def test_standard_webhooks_verifies_the_librarys_signature_and_the_sandboxs() -> None:
    library = Webhook(STANDARD).sign("msg_1", dt.datetime.fromtimestamp(NOW, dt.UTC), BODY)
    assert library == sign_standard(STANDARD, "msg_1", NOW, BODY)  # two implementations agree
    headers = {"Webhook-Id": "msg_1", "Webhook-Timestamp": str(NOW), "Webhook-Signature": library}
    event = verify("standard", [STANDARD], headers, BODY, now_s=NOW + 10)
    assert (event.event_id, event.payload["type"]) == ("msg_1", "refund.succeeded")
    # A rotation: the endpoint knows the new and the old secret; the sender may sign with both.
    both = f"{sign_standard(OTHER, 'msg_1', NOW, BODY)} {library}"
    assert verify("standard", [OTHER], headers | {"Webhook-Signature": both}, BODY, now_s=NOW).event_id == "msg_1"
    assert verify("standard", [OTHER, STANDARD], headers, BODY, now_s=NOW).event_id == "msg_1"


def test_stripe_signs_t_dot_body_with_the_whole_secret_in_hex() -> None:
    expected = hmac.new(STRIPE.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign_stripe(STRIPE, NOW, BODY) == f"t={NOW},v1={expected}"
    header = f"t={NOW},v0=ignored,v1={'0' * 64},v1={expected}"  # any v1 may match; other schemes ignored
    event = verify("stripe", [STRIPE], {"stripe-signature": header}, BODY, now_s=NOW + 299)
    assert (event.event_id, event.signed_at.timestamp()) == ("evt_1", NOW)


@pytest.mark.parametrize("scheme", ["standard", "stripe"])
def test_a_forged_signature_is_401_and_a_stale_or_malformed_one_400(scheme: str) -> None:
    secret = STANDARD if scheme == "standard" else STRIPE
    forged = OTHER if scheme == "standard" else "whsec_not_the_endpoints"

    def refused(headers: dict[str, str], body: bytes = BODY, now_s: float = NOW) -> WebhookRefused:
        with pytest.raises(WebhookRefused) as info:
            verify(scheme, [secret], headers, body, now_s=now_s)
        return info.value

    good = signed_headers(scheme, secret, "evt_1", BODY, timestamp=NOW)
    assert refused(signed_headers(scheme, forged, "evt_1", BODY, timestamp=NOW)).status == 401
    assert refused(good, body=BODY + b" ").status == 401  # the body is what is signed, byte for byte
    stale = refused(good, now_s=NOW + TOLERANCE_S + 1)
    assert (stale.status, stale.why) == (400, "stale")
    # Standard Webhooks refuses a timestamp too far ahead as well; Stripe's SDK does not.
    if scheme == "standard":
        assert refused(good, now_s=NOW - TOLERANCE_S - 1).why == "stale"
    else:
        assert verify(scheme, [secret], good, BODY, now_s=NOW - TOLERANCE_S - 1).event_id == "evt_1"
    assert refused({}).status == 400
    assert refused(signed_headers(scheme, secret, "evt_1", b"[1]", timestamp=NOW), body=b"[1]").status == 400


BASE: dict[str, Any] = {
    "targets": {
        "payments": {
            "base_url": "http://127.0.0.1:8900",
            "webhooks": {"scheme": "stripe", "secret": "${HOOK}"},
            "tenants": {"acme": {"headers": {"Authorization": "Bearer a"}, "webhook_secret": "whsec_acme"}},
        }
    },
    "actions": {
        "payments.payout.create": {
            "target": "payments",
            "request": {"method": "POST", "path": "/v1/payouts"},
            "webhooks": {
                "object": "data.object",
                "key": "metadata.idempotency_key",
                "succeeded": ["payout.paid"],
                "failed": ["payout.failed"],
                "pending": ["payout.created"],
            },
        }
    },
}
ENV = {"HOOK": "whsec_the_targets"}


def _load(tmp_path: Path, data: dict[str, Any]) -> Any:
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_actions(path, environ=ENV)


def _problems(tmp_path: Path, data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ActionsFileError) as info:
        _load(tmp_path, data)
    assert "whsec_the_targets" not in str(info.value)  # a secret is never quoted back
    return info.value.problems


def test_an_event_is_read_by_the_actions_mapping(tmp_path: Path) -> None:
    cfg = _load(tmp_path, BASE)
    target = cfg.targets["payments"]
    assert target.webhook_secrets(None) == ["whsec_the_targets"] and target.webhook_secrets("acme") == ["whsec_acme"]
    # A tenant not listed under tenants has no endpoint: never the target's secret (review of issue 50, 4).
    assert target.webhook_secrets("globex") == [] and target.webhook_tenants == ["acme"]
    event = {"type": "payout.paid", "data": {"object": {"id": "po_1", "metadata": {"idempotency_key": "acme:p-1"}}}}
    (reading,) = readings(cfg, "payments", event)
    assert (reading.outcome.value, reading.provider_key, reading.reference) == ("succeeded", "acme:p-1", "po_1")
    assert readings(cfg, "payments", {"type": "payout.updated", "data": {}}) == []
    assert "whsec" not in repr(cfg)


@pytest.mark.parametrize(
    ("change", "path", "says"),
    [
        (
            lambda d: (d["targets"]["payments"].pop("webhooks"), d["targets"]["payments"].pop("tenants")),
            "actions.payments.payout.create.webhooks",
            "no webhooks",
        ),
        (
            lambda d: d["targets"]["payments"]["webhooks"].update(scheme="svix"),
            "targets.payments.webhooks.scheme",
            "standard",
        ),
        (
            lambda d: d["targets"]["payments"]["webhooks"].update(scheme="standard", secret="whsec_!!notbase64"),
            "targets.payments.webhooks",
            "base64",
        ),
        (
            lambda d: d["targets"]["payments"]["webhooks"].update(scheme="standard", secret="whsec_c2hvcnQ="),
            "targets.payments.webhooks",
            "24-512",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(pending=["payout.paid"]),
            "actions.payments.payout.create.webhooks",
            "both succeeded and pending",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(succeeded=[], failed=[], pending=[]),
            "actions.payments.payout.create.webhooks",
            "at least one event type",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(key="metadata..key"),
            "actions.payments.payout.create.webhooks.key",
            "dotted path",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"].update(result_reference=None),
            "actions.payments.payout.create.webhooks",
            None,  # key still names it: no problem
        ),
        (
            lambda d: (
                d["actions"]["payments.payout.create"].update(result_reference=None),
                d["actions"]["payments.payout.create"]["webhooks"].pop("key"),
            ),
            "actions.payments.payout.create.webhooks",
            "declare `key` or `reference`",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(match={"amount": "{amount}"}),
            "actions.payments.payout.create.webhooks.match",
            "need the action's `args:` list",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(match={"currency": "eur"}),
            "actions.payments.payout.create.webhooks.match",
            "compares no argument",
        ),
        (
            lambda d: d["actions"]["payments.payout.create"]["webhooks"].update(when="payout.paid"),
            "actions.payments.payout.create.webhooks.when",
            "Extra inputs",
        ),
    ],
)
def test_every_mistake_in_a_webhooks_block_names_its_path(tmp_path: Path, change: Any, path: str, says: Any) -> None:
    data = copy.deepcopy(BASE)
    change(data)
    if says is None:
        _load(tmp_path, data)
        return
    problems = _problems(tmp_path, data)
    assert any(p == path and says in m for p, m in problems), problems


def test_a_tenants_webhook_secret_needs_the_targets_scheme(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["targets"]["payments"].pop("webhooks")
    data["actions"]["payments.payout.create"].pop("webhooks")
    problems = _problems(tmp_path, data)
    assert any(
        p == "targets.payments" and "tenants.acme.webhook_secret needs webhooks.scheme" in m for p, m in problems
    )
