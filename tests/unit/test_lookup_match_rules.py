"""Lookups that verify what they adopt (lookup.match) and lookups that are reads (issue 50, points 2-3):
the loader's rules, the field comparison (outbox/actions/matching.py) and what a lookup answer says."""

from __future__ import annotations

import copy
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.actions.matching import MISSING, MatchRule, MissingArgument, mismatches, same
from workers.provider.actions import ActionsFileError, load_actions
from workers.provider.lookups import LookupResult, interpret_lookup, verify_found
from workers.provider.probe_args import other_intent

WHERE = "actions.payments.refund.by_order.lookup"
BY_ORDER: dict[str, Any] = {
    "request": {"method": "GET", "path": "/v1/refunds", "query": {"order_id": "{order_id}"}},
    "items": "data",
    "match": {
        "order_id": "{order_id}",
        "amount": "{amount}",
        "currency": {"equals": "{currency}", "compare": "casefold"},
    },
    "authoritative_not_found": True,
}
DOC: dict[str, Any] = {
    "targets": {"payments": {"base_url": "http://127.0.0.1:8900"}},
    "actions": {
        "payments.refund.by_order": {
            "target": "payments",
            "request": {"method": "POST", "path": "/v1/refunds"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 86400},
            "lookup": BY_ORDER,
            "args": ["order_id", "amount", "currency"],
            "decimal_args": ["amount"],
        }
    },
}


def with_lookup(tmp_path: Path, **changes: Any) -> Path:
    doc = copy.deepcopy(DOC)
    lookup = doc["actions"]["payments.refund.by_order"]["lookup"]
    for k, v in changes.items():
        if v is None:
            lookup.pop(k, None)
        else:
            lookup[k] = v
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def refused(path: Path) -> str:
    with pytest.raises(ActionsFileError) as info:
        load_actions(path, environ={})
    return str(info.value)


# --- the loader ---------------------------------------------------------------------------------


def test_a_lookup_by_business_reference_with_match_loads(tmp_path: Path) -> None:
    lookup = load_actions(with_lookup(tmp_path), environ={}).action("payments.refund.by_order").lookup
    assert lookup is not None and not lookup.by_key and lookup.items == "data"
    assert lookup.match["currency"] == MatchRule(equals="{currency}", compare="casefold")


def test_a_lookup_not_by_key_without_match_is_refused_naming_the_path_and_the_fix(tmp_path: Path) -> None:
    message = refused(with_lookup(tmp_path, match=None))
    assert f"{WHERE}:" in message and "add lookup.match" in message and "{idempotency_key}" in message
    # By the key (its request names it), the key is what tells ours apart: no match needed.
    by_key = {"method": "GET", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}}
    assert load_actions(with_lookup(tmp_path, match=None, request=by_key), environ={})
    # A key_field alone does not make a lookup by reference one by key (review of issue 50, finding 2).
    assert "key_field alone" in refused(with_lookup(tmp_path, match=None, key_field="metadata.key"))


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE", "put"])
def test_a_lookup_that_would_write_is_refused_naming_the_path(tmp_path: Path, method: str) -> None:
    message = refused(with_lookup(tmp_path, request=BY_ORDER["request"] | {"method": method}))
    assert f"{WHERE}:" in message and f"method {method.upper()} acts on the provider" in message
    assert "GET or HEAD" in message


def test_a_post_lookup_is_a_read_only_when_declared_a_search(tmp_path: Path) -> None:
    post = BY_ORDER["request"] | {"method": "POST", "path": "/v1/refunds/search"}
    message = refused(with_lookup(tmp_path, request=post))
    assert f"{WHERE}:" in message and "lookup.search: true" in message
    lookup = load_actions(with_lookup(tmp_path, request=post, search=True), environ={}).action(
        "payments.refund.by_order"
    )
    assert lookup.lookup is not None and lookup.lookup.search
    assert "declares a POST search" in refused(with_lookup(tmp_path, search=True))  # on a GET: misplaced


def test_head_lookups_are_reads_by_key_only(tmp_path: Path) -> None:
    head = {"method": "HEAD", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}}
    assert load_actions(with_lookup(tmp_path, request=head, match=None), environ={})
    assert "must ask by the key" in refused(with_lookup(tmp_path, request=head | {"query": {"o": "{order_id}"}}))


def test_match_must_compare_declared_arguments(tmp_path: Path) -> None:
    message = refused(with_lookup(tmp_path, match={"amount": "{amout}"}))
    assert f"{WHERE}.match:" in message and "['amout'] are not argument names" in message
    assert "compares no argument" in refused(with_lookup(tmp_path, match={"object": "refund"}))
    assert "not a dotted path" in refused(with_lookup(tmp_path, match={"a..b": "{amount}"}))
    # The key the provider saw may be compared (a provider that keeps it in metadata).
    assert load_actions(with_lookup(tmp_path, match={"metadata.key": "{idempotency_key}"}), environ={})


def test_items_field_still_loads_as_the_older_name_of_items(tmp_path: Path) -> None:
    lookup = load_actions(with_lookup(tmp_path, items=None, items_field="results"), environ={}).action(
        "payments.refund.by_order"
    )
    assert lookup.lookup is not None and lookup.lookup.items == "results"


# --- the comparison -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "wanted", "equal"),
    [
        ("25.00", 25.0, True),
        ("25.00", "25", True),
        (25, Decimal("25.00"), True),
        ("12.50", "5.00", False),
        ("EUR", "eur", False),
        ("007", "7", False),  # an id with leading zeros is text
        ("1e3", "1000", False),
        (True, 1, False),
        (None, None, True),
        (MISSING, None, False),  # a field the object lacks never matches
        ({"a": "1.0"}, {"a": 1}, True),
    ],
)
def test_values_compare_as_the_provider_writes_them_decimals_as_decimals(found: Any, wanted: Any, equal: bool) -> None:
    assert same(found, wanted) is equal


def test_casefold_compares_text_case_insensitively() -> None:
    assert same("eur", "EUR", "casefold") and not same("eur", "usd", "casefold")


def test_mismatches_name_each_field_and_a_missing_argument_is_no_verdict() -> None:
    match: dict[str, str | MatchRule] = {"amount": "{amount}", "order.id": "order-{order_id}"}
    found = {"amount": "5.00", "order": {"id": "order-o-1"}}
    wrong = mismatches(found, match, {"amount": "12.50", "order_id": "o-1"})
    assert [(m.path, m.found, m.wanted) for m in wrong] == [("amount", "5.00", "12.50")]
    assert mismatches(found, match, {"amount": 5, "order_id": "o-1"}) == []
    with pytest.raises(MissingArgument):
        mismatches(found, match, {"amount": "12.50"})


# --- what a lookup answer says ------------------------------------------------------------------


def spec(tmp_path: Path, **changes: Any) -> Any:
    return load_actions(with_lookup(tmp_path, **changes), environ={}).action("payments.refund.by_order").lookup


def refund(ref: str, amount: str, **over: Any) -> dict[str, Any]:
    return {"id": ref, "status": "succeeded", "order_id": "o-1", "amount": amount, "currency": "eur"} | over


ARGS = {"order_id": "o-1", "amount": "12.50", "currency": "EUR"}


def answer(tmp_path: Path, *objects: dict[str, Any], args: dict[str, Any] = ARGS) -> LookupResult:
    body = json.dumps({"object": "list", "data": list(objects)}).encode()
    return interpret_lookup(200, body, spec(tmp_path), "id", "t1:k1", args=args)


def test_only_others_objects_found_is_a_not_found(tmp_path: Path) -> None:
    found = answer(tmp_path, refund("re_other", "5.00"))
    assert (found.outcome, found.obj, found.provider_reference) == ("not_found", None, None)
    assert "none of them ours" in found.reason and "amount differs" in found.reason
    assert "5.00" not in found.reason  # values can be personal data: paths only


def test_the_one_matching_candidate_is_adopted_among_others(tmp_path: Path) -> None:
    found = answer(tmp_path, refund("re_other", "5.00"), refund("re_ours", "12.5"))
    assert (found.outcome, found.state, found.provider_reference) == ("found", "succeeded", "re_ours")


def test_two_matching_candidates_are_ambiguous_with_both_references(tmp_path: Path) -> None:
    found = answer(tmp_path, refund("re_a", "12.50"), refund("re_b", "12.50"), refund("re_c", "1.00"))
    assert found.outcome == "ambiguous" and found.candidates == ("re_a", "re_b") and found.obj is None


def test_an_intent_without_a_compared_argument_cannot_adopt(tmp_path: Path) -> None:
    found = answer(tmp_path, refund("re_ours", "12.50"), args={"order_id": "o-1"})  # purged arguments
    assert found.outcome == "unavailable" and "cannot verify" in found.reason


def test_a_hooks_found_object_is_held_to_match_too(tmp_path: Path) -> None:
    lookup = spec(tmp_path)
    theirs = LookupResult("found", "status='succeeded'", "succeeded", refund("re_x", "5.00"), "re_x")
    assert verify_found(theirs, lookup, ARGS, "t1:k1").outcome == "not_found"
    ours = LookupResult("found", "status='succeeded'", "succeeded", refund("re_y", "12.50"), "re_y")
    assert verify_found(ours, lookup, ARGS, "t1:k1") == ours
    assert verify_found(LookupResult("found", "no body", "succeeded"), lookup, ARGS, "k").outcome == "unavailable"


def test_two_objects_under_one_key_are_ambiguous_not_unavailable(tmp_path: Path) -> None:
    by_key = {"method": "GET", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}}
    lookup = spec(tmp_path, request=by_key, match=None)
    body = json.dumps({"data": [refund("re_1", "1"), refund("re_2", "1")]}).encode()
    found = interpret_lookup(200, body, lookup, "id", "k", args=ARGS)
    assert found.outcome == "ambiguous" and found.candidates == ("re_1", "re_2")


def test_the_example_file_has_a_lookup_by_business_reference_that_verifies() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "actions.yaml"
    lookup = load_actions(example, environ={}).action("payments.partial_refund.create").lookup
    assert lookup is not None and not lookup.by_key and {"order_id", "amount", "currency"} <= set(lookup.match)


def test_the_probe_asks_for_another_intent_by_a_compared_argument_the_search_does_not_use(tmp_path: Path) -> None:
    cfg = load_actions(with_lookup(tmp_path), environ={}).action("payments.refund.by_order")
    assert other_intent(ARGS, cfg) == {**ARGS, "amount": "13.50"}
    only_order = load_actions(with_lookup(tmp_path, match={"order_id": "{order_id}"}), environ={})
    assert other_intent(ARGS, only_order.action("payments.refund.by_order")) == {
        **ARGS,
        "order_id": "o-1-probe-changed",
    }


def test_a_head_lookup_by_key_counts_a_2xx_as_the_effect_existing(tmp_path: Path) -> None:
    head = {"method": "HEAD", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}}
    lookup = spec(tmp_path, request=head, match=None, exists_means="succeeded")
    assert interpret_lookup(200, b"", lookup, "id", "k", args=ARGS).state == "succeeded"
    assert interpret_lookup(404, b"", lookup, "id", "k", args=ARGS).outcome == "not_found"


def test_provider_fencing_needs_a_lookup_that_names_the_key(tmp_path: Path) -> None:
    doc = copy.deepcopy(DOC)
    doc["actions"]["payments.refund.by_order"] |= {"provider_fencing": True, "fencing_header": "X-Fencing-Token"}
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    message = refused(path)
    assert "actions.payments.refund.by_order:" in message and "cannot fence" in message
