"""Pure logic of the sandbox: rule parsing and matching, key store, fencing, validation."""

from __future__ import annotations

import email.utils
import time
from decimal import Decimal

import pytest

from workers.sandbox.config import SandboxConfig, SettingError
from workers.sandbox.faults import MODES, FaultBook, RuleError, parse_rule
from workers.sandbox.idempotency import FencingBook, KeyInUse, KeyMismatch, KeyStore, StoredResponse, params_digest
from workers.sandbox.resources import Rejection, validate_refund
from workers.sandbox.responses import retry_after_value


def test_every_mode_parses() -> None:
    for mode in MODES:
        assert parse_rule({"mode": mode}).mode == mode


@pytest.mark.parametrize(
    "body,field",
    [
        ({"mode": "nope"}, "mode"),
        ({}, "mode"),
        ({"mode": "latency", "x": 1}, "x"),
        ({"mode": "latency", "probability": -0.1}, "probability"),
        ({"mode": "latency", "count": 0}, "count"),
        ({"mode": "latency", "status": 99}, "status"),
        ({"mode": "latency", "retry_after_http_date": 1}, "retry_after_http_date"),
        ({"mode": "latency", "seed": True}, "seed"),
        ({"mode": "rate_limited_429", "quota_per_s": 0}, "quota_per_s"),
        ([1], "body"),
    ],
)
def test_bad_rules_name_the_field(body: object, field: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(body)
    assert info.value.field == field


def test_rule_matching_and_count() -> None:
    book = FaultBook()
    book.add({"mode": "unavailable_503", "method": "get", "path": "/v1/*", "count": 2})
    assert book.select("POST", "/v1/refunds", None, "t") is None
    assert book.select("GET", "/v1/refunds", None, "t") is not None
    assert book.select("GET", "/v1/tickets", None, "t") is not None
    assert book.select("GET", "/v1/tickets", None, "t") is None  # exhausted


def test_a_quota_admits_so_many_per_trailing_second_and_refuses_the_rest() -> None:
    book = FaultBook()
    book.add({"mode": "rate_limited_429", "path": "/v1/refunds", "quota_per_s": 3})
    fired = [book.select("POST", "/v1/refunds", f"k{i}", "t") is not None for i in range(5)]
    assert fired == [False, False, False, True, True]  # three admitted, the rest get 429
    assert book.select("POST", "/v1/tickets", "k9", "t") is None  # another path: not this quota
    time.sleep(1.05)
    assert book.select("POST", "/v1/refunds", "k6", "t") is None  # the window moved on


def test_probability_is_reproducible_per_seed() -> None:
    def draws(seed: int) -> list[bool]:
        book = FaultBook()
        book.add({"mode": "latency", "probability": 0.3, "seed": seed})
        return [book.select("POST", "/v1/refunds", "k", "t") is not None for _ in range(50)]

    assert draws(7) == draws(7) != draws(8)


def test_key_store_replay_mismatch_in_use_and_retention() -> None:
    store = KeyStore()
    d1, d2 = params_digest("POST", "/v1/refunds", {"a": 1}), params_digest("POST", "/v1/refunds", {"a": 2})
    assert store.begin("t", "k", d1, now=0, retention_s=10) is None
    with pytest.raises(KeyInUse):
        store.begin("t", "k", d1, now=1, retention_s=10)
    with pytest.raises(KeyMismatch):
        store.begin("t", "k", d2, now=1, retention_s=10)
    store.complete("t", "k", StoredResponse(200, b"{}", "req_1"))
    assert store.begin("t", "k", d1, now=2, retention_s=10) == StoredResponse(200, b"{}", "req_1")
    assert store.begin("other", "k", d2, now=2, retention_s=10) is None  # tenant scope
    assert store.begin("t", "k", d2, now=10, retention_s=10) is None  # expired: a new request


def test_release_frees_only_unfinished_keys() -> None:
    store = KeyStore()
    store.begin("t", "k", "d", 0, 10)
    store.release("t", "k")
    assert store.begin("t", "k", "d", 0, 10) is None
    store.complete("t", "k", StoredResponse(200, b"x", "r"))
    store.release("t", "k")
    assert store.begin("t", "k", "d", 0, 10) is not None


def test_digest_is_canonical_and_covers_the_endpoint() -> None:
    assert params_digest("POST", "/v1/a", {"x": 1, "y": 2}) == params_digest("POST", "/v1/a", {"y": 2, "x": 1})
    assert params_digest("POST", "/v1/a", {"x": 1}) != params_digest("POST", "/v1/b", {"x": 1})


def test_fencing_admits_equal_or_higher() -> None:
    book = FencingBook()
    assert book.admit("t", "k", 3) is None
    assert book.admit("t", "k", 3) is None
    assert book.admit("t", "k", 2) == 3
    assert book.admit("t", "k", 4) is None and book.admit("u", "k", 1) is None


@pytest.mark.parametrize("amount", ["1", "0.01", "12.5", "10000.00"])
def test_valid_amounts(amount: str) -> None:
    assert validate_refund({"order_id": "o", "amount": amount, "currency": "EUR"}, Decimal("10000"))["amount"] == amount


@pytest.mark.parametrize(
    "amount,status",
    [("0", 422), ("0.00", 422), ("1.001", 422), ("1,00", 422), (" 1", 422), ("NaN", 422), (1, 422), ("10000.01", 402)],
)
def test_invalid_amounts(amount: object, status: int) -> None:
    with pytest.raises(Rejection) as info:
        validate_refund({"order_id": "o", "amount": amount, "currency": "EUR"}, Decimal("10000"))
    assert info.value.status == status


def test_retry_after_forms() -> None:
    assert retry_after_value(1.2, http_date=False) == "2"
    when = email.utils.parsedate_to_datetime(retry_after_value(5, http_date=True)).timestamp()
    assert 4 <= when - time.time() <= 6.01


def test_config_update_is_all_or_nothing() -> None:
    config = SandboxConfig()
    with pytest.raises(SettingError):
        config.update({"retention_s": 5, "index_lag_s": -1})
    assert config.retention_s == 86400.0
    config.update({"over_limit_amount": "50.5", "idempotency": False})
    assert config.over_limit_amount == Decimal("50.5") and config.idempotency is False


def test_a_first_per_key_rule_fails_only_a_keys_first_request():
    book = FaultBook()
    book.add({"mode": "commit_then_504", "method": "POST", "first_per_key": True})
    assert book.select("POST", "/v1/refunds", "k1", "t") is not None
    assert book.select("POST", "/v1/refunds", "k1", "t") is None  # the retry passes
    assert book.select("GET", "/v1/refunds", "k1", "t") is None  # another method: not the rule's
    assert book.select("POST", "/v1/refunds", "k2", "t") is not None
    book.forget_keys()
    assert book.select("POST", "/v1/refunds", "k1", "t") is not None
