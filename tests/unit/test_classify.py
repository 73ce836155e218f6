"""The one failure table: every row, and the properties that keep it honest."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.ledger.states import PROVABLY_NOT_EXECUTED, AttemptClass
from workers.provider.classify import (
    DEFAULT_STATUS_MAP,
    LocalValidationError,
    Progress,
    classify_exception,
    classify_response,
    status_class,
)

A = AttemptClass
NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
OK_BODY = json.dumps({"id": "re_123", "status": "succeeded"}).encode()
REQ = httpx.Request("POST", "http://x/v1/refunds")


def classify(status: int, body: bytes = b"", headers: dict[str, str] | None = None, **kw: object):  # type: ignore[no-untyped-def]
    return classify_response(status, headers or {}, body, now=NOW, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "klass"),
    [
        (httpx.ConnectError("refused", request=REQ), A.NOT_SENT),
        (httpx.ConnectError("[Errno -2] Name or service not known", request=REQ), A.NOT_SENT),
        (httpx.ConnectTimeout("t", request=REQ), A.NOT_SENT),
        (httpx.PoolTimeout("t", request=REQ), A.NOT_SENT),
        (LocalValidationError("amount must be a decimal string"), A.NOT_SENT),
        (httpx.UnsupportedProtocol("ftp", request=REQ), A.NOT_SENT),
        # Part of the request may have arrived: conservative.
        (httpx.WriteError("broken pipe", request=REQ), A.AMBIGUOUS),
        (httpx.WriteTimeout("t", request=REQ), A.AMBIGUOUS),
        (httpx.ReadTimeout("t", request=REQ), A.AMBIGUOUS),
        (httpx.ReadError("reset by peer", request=REQ), A.AMBIGUOUS),
        (httpx.RemoteProtocolError("Server disconnected", request=REQ), A.AMBIGUOUS),
        (RuntimeError("a bug mid-call"), A.AMBIGUOUS),
    ],
)
def test_transport_failures(exc: BaseException, klass: AttemptClass) -> None:
    result = classify_exception(exc)
    assert result.klass is klass
    assert result.status_code is None and result.reason


@pytest.mark.parametrize(
    ("status", "klass"),
    [
        (429, A.NOT_PROCESSED),
        (503, A.NOT_PROCESSED),
        (400, A.REJECTED),
        (401, A.REJECTED),
        (403, A.REJECTED),
        (404, A.REJECTED),
        (409, A.REJECTED),
        (422, A.REJECTED),
        (418, A.REJECTED),
        (500, A.AMBIGUOUS),
        (502, A.AMBIGUOUS),
        (504, A.AMBIGUOUS),
        (507, A.AMBIGUOUS),
        (100, A.AMBIGUOUS),
        (301, A.AMBIGUOUS),
        (304, A.AMBIGUOUS),
    ],
)
def test_status_rows(status: int, klass: AttemptClass) -> None:
    assert classify(status, b'{"error": {"code": "x"}}').klass is klass


def test_2xx_with_reference_succeeds() -> None:
    result = classify(201, OK_BODY, {"Request-Id": "req_9"})
    assert result.klass is A.SUCCEEDED
    assert result.provider_reference == "re_123" and result.provider_request_id == "req_9"
    assert result.body == {"id": "re_123", "status": "succeeded"} and result.status_code == 201


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"   ",
        b'{"id": "re_1',
        b"<html>ok</html>",
        b'["re_1"]',
        b'{"status": "ok"}',
        b'{"id": ""}',
        b'{"id": null}',
        b'{"id": {"x": 1}}',
        b"\xff\xfe",
    ],
)
def test_2xx_without_provable_reference_is_ambiguous(body: bytes) -> None:
    result = classify(200, body)
    assert result.klass is A.AMBIGUOUS and result.provider_reference is None


def test_dotted_reference_and_no_reference_required() -> None:
    assert classify(200, b'{"data": {"id": 7}}', result_reference="data.id").provider_reference == "7"
    assert classify(201, b"{}", result_reference=None).klass is A.SUCCEEDED
    assert classify(204, b"", result_reference=None).klass is A.AMBIGUOUS


PROGRESS = Progress("status", pending=("pending", "processing"), failed=("failed", "canceled"))


def test_accepted_is_not_completed() -> None:
    # A 202, with or without a body, is the provider taking the request, not finishing it.
    assert classify(202, b'{"id": "po_1"}').klass is A.ACCEPTED
    assert classify(202, b'{"id": "po_1"}').provider_reference == "po_1"
    assert classify(202, b"").klass is A.ACCEPTED
    # A 2xx whose status field says pending/processing is accepted; failed is the provider's failure.
    pending = classify(200, b'{"id": "po_2", "status": "processing"}', progress=PROGRESS)
    assert (pending.klass, pending.provider_reference) == (A.ACCEPTED, "po_2")
    failed = classify(200, b'{"id": "po_3", "status": "failed"}', progress=PROGRESS)
    assert failed.klass is A.REJECTED and failed.failed_at_provider and failed.provider_reference == "po_3"
    done = classify(200, b'{"id": "po_4", "status": "succeeded"}', progress=PROGRESS)
    assert done.klass is A.SUCCEEDED and not done.failed_at_provider
    # An action whose provider says 202 for done says so (status_map); without a lookup's lists a
    # status field proves nothing either way.
    assert classify(202, b'{"id": "x"}', status_map={202: A.SUCCEEDED}).klass is A.SUCCEEDED
    assert classify(200, b'{"id": "po_5", "status": "pending"}').klass is A.SUCCEEDED


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_parsed(status: int) -> None:
    assert classify(status, b"", {"Retry-After": "12"}).retry_after_s == 12.0
    assert classify(status, b"", {"Retry-After": "Sat, 01 Mar 2025 12:01:00 GMT"}).retry_after_s == 60.0
    assert classify(status, b"").retry_after_s is None
    assert classify(status, b"", {"Retry-After": "later"}).klass is A.NOT_PROCESSED


def test_status_map_overrides() -> None:
    assert classify(409, b"{}", status_map={409: A.AMBIGUOUS}).klass is A.AMBIGUOUS
    # The action's map is consulted first, exact code then family, before the defaults.
    assert classify(503, b"{}", status_map={"5xx": A.REJECTED}).klass is A.REJECTED
    assert classify(503, b"{}", status_map={409: A.AMBIGUOUS}).klass is A.NOT_PROCESSED
    # Mapping a code to success still needs the reference as proof.
    assert classify(409, b'{"id": "re_1"}', status_map={409: A.SUCCEEDED}).klass is A.SUCCEEDED
    assert classify(409, b'{"error": 1}', status_map={409: A.SUCCEEDED}).klass is A.AMBIGUOUS


def test_default_map_is_the_design_table() -> None:
    assert {c for c, k in DEFAULT_STATUS_MAP.items() if k is A.NOT_PROCESSED} >= {429, 503}
    assert all(DEFAULT_STATUS_MAP[c] is A.REJECTED for c in (400, 401, 403, 404, 409, 422))
    assert all(DEFAULT_STATUS_MAP[c] is A.AMBIGUOUS for c in (500, 502, 504))


@given(st.integers(500, 599).filter(lambda c: c != 503), st.binary(max_size=64))
def test_any_5xx_but_503_is_ambiguous(status: int, body: bytes) -> None:
    assert classify(status, body).klass is A.AMBIGUOUS


@given(st.integers(400, 499).filter(lambda c: c not in (408, 425, 429)), st.binary(max_size=64))
def test_other_4xx_rejected(status: int, body: bytes) -> None:
    assert classify(status, body).klass is A.REJECTED


@given(st.integers(200, 299).filter(lambda s: s != 202), st.binary(max_size=64))
def test_2xx_without_parseable_reference_is_ambiguous(status: int, body: bytes) -> None:
    try:
        parsed = json.loads(body)
        has_ref = (
            isinstance(parsed, dict)
            and parsed.get("id") not in (None, "")
            and not isinstance(parsed.get("id"), (dict, list, bool))
        )
    except ValueError:
        has_ref = False
    result = classify(status, body)
    assert result.klass is (A.SUCCEEDED if has_ref else A.AMBIGUOUS)


@given(
    st.integers(200, 299).filter(lambda s: s != 202),  # 202 Accepted: not completed (test_accepted_is_not_completed)
    st.one_of(st.text(min_size=1), st.integers()),
    st.dictionaries(st.text(), st.integers()),
)
def test_2xx_with_reference_is_success(status: int, ref: object, extra: dict[str, int]) -> None:
    body = json.dumps({**extra, "id": ref}).encode()
    result = classify(status, body)
    assert result.klass is A.SUCCEEDED and result.provider_reference == str(ref)


@given(st.integers(100, 599), st.binary(max_size=32), st.sampled_from(["id", None]))
def test_never_succeeds_outside_2xx_and_never_raises(status: int, body: bytes, ref: str | None) -> None:
    result = classify(status, body, result_reference=ref)
    assert result.klass in set(A) - {A.PENDING, A.NOT_SENT}
    if not 200 <= status < 300:
        assert result.klass is not A.SUCCEEDED
    # A response proves the request left, so "not sent" is never the answer to one.
    assert result.klass is not A.NOT_SENT


def test_only_transport_failures_before_send_are_not_sent() -> None:
    assert status_class(503) in PROVABLY_NOT_EXECUTED
    assert status_class(500) not in PROVABLY_NOT_EXECUTED
    assert classify_exception(httpx.ReadTimeout("t", request=REQ)).provably_not_executed is False


def test_an_http_date_retry_after_is_read_against_the_responses_date_header() -> None:
    # The provider's clock wrote both; this worker's clock may be minutes off (F17).
    headers = {"Retry-After": "Sat, 01 Mar 2025 12:01:02 GMT", "Date": "Sat, 01 Mar 2025 12:01:00 GMT"}
    for worker_now in (datetime(2025, 3, 1, 12, 6, tzinfo=UTC), datetime(2025, 3, 1, 11, 56, tzinfo=UTC)):
        got = classify_response(429, headers, b"", now=worker_now)
        assert got.retry_after_s == 2.0, worker_now
    # Without a Date header the caller's clock is all there is.
    assert (
        classify_response(
            429, {"Retry-After": headers["Retry-After"]}, b"", now=datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
        ).retry_after_s
        == 62.0
    )


def test_money_passes_as_a_decimal_string_whatever_the_ledger_stored() -> None:
    """Decimal("25.00") is stored as 25 (numbers are canonicalised by value); the worker refused the
    int it read back, so a whole amount failed where 12.50 went through."""
    from decimal import Decimal

    from outbox.ledger.envelope import build_envelope, loads_exact
    from workers.provider.classify import LocalValidationError
    from workers.provider.http_request import check_decimal_args

    for given_amount, sent in ((Decimal("25.00"), "25"), (Decimal("12.50"), "12.5"), ("25.00", "25.00"), (7, "7")):
        env = build_envelope(tenant="t", action="a.b", args={"amount": given_amount}, subject="s")
        stored = loads_exact(env.canonical_args)
        assert check_decimal_args(stored, ["amount"])["amount"] == sent
    for bad in (True, [1], "12,50", Decimal("NaN")):
        with pytest.raises(LocalValidationError):
            check_decimal_args({"amount": bad}, ["amount"])
