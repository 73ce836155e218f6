"""A resend carries its key in the header the provider first saw it in (review of issue 50, finding 8):
the request on record says which (workers/dispatch/same_request.py); another header, or none, is a
person's to decide, told both versions."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_same_request import claim, go, recorded
from workers.dispatch.same_request import Resend, key_header_of
from workers.engine.outcomes import NeedsPerson
from workers.provider.actions import parse_actions

DOC = {
    "targets": {"p": {"base_url": "https://pay.example.com/api"}},
    "actions": {
        "keyed": {
            "target": "p",
            "request": {"method": "POST", "path": "/v1/orders"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 600},
        },
        "unkeyed": {"target": "p", "request": {"method": "POST", "path": "/v1/orders"}},
    },
}


def test_the_header_is_compared_as_http_does_without_case():
    actions = parse_actions(DOC)
    assert key_header_of(actions.action("keyed")) == "idempotency-key"
    assert key_header_of(actions.action("unkeyed")) == ""


def test_the_same_header_resends_whatever_else_changed():
    assert isinstance(go(claim(sent=recorded()), "bbbb", key_header="idempotency-key"), Resend)
    keyless = recorded(key_header="")  # sent without a key header, and still so
    assert isinstance(go(claim(sent=keyless), "bbbb", key_header=""), Resend)


def test_a_renamed_or_removed_header_is_a_person_told_both_versions():
    renamed = go(claim(sent=recorded()), "bbbb", key_header="x-idempotency-key")
    assert isinstance(renamed, NeedsPerson)
    assert "its key went in header idempotency-key, the action now sends it in header x-idempotency-key" in renamed.why
    assert "first request sent under aaaa" in renamed.why and "current bbbb" in renamed.why
    removed = go(claim(sent=recorded()), "bbbb", key_header="")
    assert isinstance(removed, NeedsPerson) and "now sends it in no header" in removed.why
    added = go(claim(sent=recorded(key_header="")), "bbbb", key_header="idempotency-key")
    assert isinstance(added, NeedsPerson) and "its key went in no header" in added.why


def test_a_request_recorded_before_0021_is_resent_only_under_its_own_version():
    legacy = recorded(key_header=None)  # the header it went in is not on record
    assert isinstance(go(claim(sent=legacy), "aaaa"), Resend), "its version fixes the header"
    person = go(claim(sent=legacy), "bbbb")
    assert isinstance(person, NeedsPerson) and "does not say which header carried its key" in person.why
    assert isinstance(go(claim(sent=replace(legacy, version="bbbb")), "bbbb"), Resend)
