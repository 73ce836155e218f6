"""What an attempt may send under its key (workers/dispatch/same_request.py), decided without I/O."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import httpx

from outbox.ledger.claims import Claim
from outbox.ledger.request_record import RequestRecord
from outbox.ledger.states import AttemptKind
from workers.dispatch.same_request import BUILD, Resend, route, without_action
from workers.engine.outcomes import NeedsPerson, Rejected
from workers.provider.http_request import request_digest

BASE_URL = "https://pay.example.com/api"
NOW = dt.datetime(2026, 12, 8, tzinfo=dt.UTC)
BODY = '{"amount_cents":500,"order_ref":"o-17"}'
PATH = "/v1/orders?v=1"


def claim(**over: object) -> Claim:
    c = Claim(
        "op",
        3,
        9,
        2,
        AttemptKind.DISPATCH,
        "t",
        "k",
        "orders.place",
        BODY,
        "d",
        "s",
        "w",
        NOW,
        None,
        2,
        None,
        NOW,
        False,
        True,
        action_version="aaaa",
    )
    return replace(c, **over)  # type: ignore[arg-type]


KEY_HEADER = "idempotency-key"


def recorded(version: str = "aaaa", base_url: str = BASE_URL, **over: object) -> RequestRecord:
    digest = request_digest("POST", str(httpx.URL(base_url + PATH)), BODY.encode())
    return replace(RequestRecord(version, "POST", PATH, BODY, digest, KEY_HEADER), **over)  # type: ignore[arg-type]


def go(c: Claim, version: str | None = "bbbb", *, http: bool = True, key_header: str = KEY_HEADER) -> object:
    return route(c, version, http=http, base_url=BASE_URL, key_header=key_header)


def test_a_first_attempt_or_earlier_ones_under_the_current_version_build() -> None:
    assert go(claim(attempt_number=1)) is BUILD  # nothing can have left
    # Submitted under another version (or none), but every attempt that may have left was claimed
    # under the current one: the deterministic build is that request again.
    assert go(claim(left_under=frozenset({"bbbb"}))) is BUILD
    assert go(claim(action_version=None, left_under=frozenset({"bbbb"}))) is BUILD


def test_the_request_on_record_is_sent_again_exactly_whatever_the_definition() -> None:
    chosen = go(claim(sent=recorded()))
    assert isinstance(chosen, Resend)
    assert (chosen.request.method, chosen.request.path, chosen.request.body) == ("POST", PATH, BODY.encode())
    assert chosen.request.query == {}  # the query is in the recorded path, as it was encoded


def test_a_moved_base_url_or_a_purged_body_is_a_person() -> None:
    moved = go(claim(sent=recorded(base_url="https://old.example.com")))
    assert isinstance(moved, NeedsPerson) and "base_url" in moved.why
    purged = go(claim(sent=recorded(body=None)))
    assert isinstance(purged, NeedsPerson) and "purged" in purged.why


def test_nothing_on_record_and_another_version_builds_only_if_nothing_can_have_left() -> None:
    assert go(claim()) is BUILD  # every earlier attempt not_sent (or proven absent)
    person = go(claim(left_under=frozenset({"aaaa"})))
    assert isinstance(person, NeedsPerson)
    assert "submitted under aaaa" in person.why and "current bbbb" in person.why
    assert "first request sent under aaaa (not on record" in person.why


def test_a_hook_connector_calls_again_only_under_the_version_it_was_sent_under() -> None:
    hooked = RequestRecord("aaaa", digest="d1")
    assert go(claim(sent=hooked), "aaaa", http=False) is BUILD
    person = go(claim(sent=hooked), "bbbb", http=False)
    assert isinstance(person, NeedsPerson) and "first request sent under aaaa" in person.why
    # An HTTP request on record, the action now a hook: the hook builds it only under that version.
    assert go(claim(sent=recorded()), "aaaa", http=False) is BUILD
    assert isinstance(go(claim(sent=recorded()), "bbbb", http=False), NeedsPerson)


def test_a_removed_action_or_purged_arguments_end_it_only_when_nothing_left() -> None:
    assert isinstance(without_action(claim()), Rejected)
    removed = without_action(claim(sent=recorded()))
    assert isinstance(removed, NeedsPerson) and "current none" in removed.why
    assert isinstance(without_action(claim(left_under=frozenset({"aaaa"}))), NeedsPerson)
    assert isinstance(go(claim(args="")), Rejected)
    purged = go(claim(args="", sent=recorded()))
    assert isinstance(purged, NeedsPerson) and "purged" in purged.why
    left = go(claim(args="", action_version="bbbb", left_under=frozenset({"bbbb"})))
    assert isinstance(left, NeedsPerson) and "purged" in left.why
