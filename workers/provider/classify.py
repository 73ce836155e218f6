"""The one failure table (DESIGN.md, "Failure classification"), as data plus two functions.

Workers and the reconciler both classify through here, so "what did this attempt prove" has
exactly one answer. When in doubt the answer is AMBIGUOUS: the cost of a wrong "not executed"
is a double refund; the cost of a wrong "ambiguous" is one lookup.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Literal

import httpx

from outbox.ledger.states import AttemptClass
from workers.provider.retry import parse_http_date, parse_retry_after

A = AttemptClass

# Status code -> class. Exact codes win over their family ("4xx"). Actions may override
# entries (``status_map`` in the actions file) with the same key forms.
DEFAULT_STATUS_MAP: dict[int | str, AttemptClass] = {
    # 429 / 503 mean "not processed" by definition: safe to retry after Retry-After.
    429: A.NOT_PROCESSED,
    503: A.NOT_PROCESSED,
    # 408 / 425: the server declined to process the request (timed out waiting for it / too
    # early); like 429 these are not business rejections, and retrying is the intended cure.
    408: A.NOT_PROCESSED,
    425: A.NOT_PROCESSED,
    # Business rejections: the provider read the request and refused it, so no effect.
    400: A.REJECTED,
    401: A.REJECTED,  # 401/403 are also authority refusals by default: a person (DEFAULT_AUTHORITY_STATUSES)
    403: A.REJECTED,
    404: A.REJECTED,
    409: A.REJECTED,
    422: A.REJECTED,
    # The provider may have committed before failing to answer.
    500: A.AMBIGUOUS,
    502: A.AMBIGUOUS,
    504: A.AMBIGUOUS,
    # 202 Accepted: the provider took the request and has not finished it (RFC 9110 15.3.3). Not
    # done: the operation waits in `accepted` and lookups settle it. An action whose provider says
    # 202 for "done" maps it back: status_map: {202: succeeded}.
    202: A.ACCEPTED,
    "1xx": A.AMBIGUOUS,  # httpx swallows informational responses; anything else here is odd
    "2xx": A.SUCCEEDED,  # only with a parseable body carrying the reference, see below
    "3xx": A.AMBIGUOUS,  # redirects are not followed: we cannot tell whether it acted
    "4xx": A.REJECTED,
    "5xx": A.AMBIGUOUS,
}

# Transport failures, checked in order (subclasses before their bases).
_EXCEPTION_TABLE: tuple[tuple[type[BaseException], AttemptClass, str], ...] = (
    # Nothing left the machine: no connection was made, or none was available.
    (httpx.ConnectTimeout, A.NOT_SENT, "connect_timeout"),
    (httpx.PoolTimeout, A.NOT_SENT, "pool_timeout"),
    (httpx.ConnectError, A.NOT_SENT, "connect_error"),  # also DNS failures and refused connections
    (httpx.UnsupportedProtocol, A.NOT_SENT, "unsupported_protocol"),
    (httpx.InvalidURL, A.NOT_SENT, "invalid_url"),
    # h11 refuses to serialise a malformed request before writing it.
    (httpx.LocalProtocolError, A.NOT_SENT, "local_protocol_error"),
    # A write error may strike after part of the request (even all of it) reached the
    # provider, which may then act on it: be conservative, never call it "not sent".
    (httpx.WriteTimeout, A.AMBIGUOUS, "write_timeout"),
    (httpx.WriteError, A.AMBIGUOUS, "write_error"),
    # The request was sent; the answer was lost.
    (httpx.ReadTimeout, A.AMBIGUOUS, "read_timeout"),
    (httpx.ReadError, A.AMBIGUOUS, "read_error"),  # connection reset mid-response
    (httpx.RemoteProtocolError, A.AMBIGUOUS, "remote_protocol_error"),  # dropped / truncated
    (httpx.DecodingError, A.AMBIGUOUS, "decoding_error"),
)

# Statuses that mean the provider refused our authority (credentials revoked or expired, a key
# without the permission), by default: the request was read and refused, so nothing was executed;
# but no retry and no change of arguments will cure it, and failing the intent would blame it for
# what an operator must fix. Such an answer goes to a person (the "needs a person" class of the
# table). A target declares its own list (targets.<name>.authority_statuses): a provider whose 403
# means something else (SendGrid: a temporary block; GitHub: also rate limits) leaves it out.
DEFAULT_AUTHORITY_STATUSES: tuple[int, ...] = (401, 403)

_REQUEST_ID_HEADERS = ("request-id", "x-request-id", "x-amzn-requestid", "x-correlation-id")


@dataclass(frozen=True)
class KeyConflict:
    """A provider's answer "this key was first used with another request": a row of KEY_CONFLICTS."""

    answer: str  # the reason's tail (the attempt's error says which row matched)
    statuses: tuple[int, ...]  # the HTTP statuses it comes with; () any 4xx
    matches: Callable[[dict[str, Any]], bool]  # on the JSON body
    names_object: bool = False  # it names the object the key already made (kept as the reference)


def _error_reasons(body: dict[str, Any]) -> list[Any]:
    errors = extract(body, "error.errors")
    return [e.get("reason") for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def _conflicting_resource(body: dict[str, Any]) -> str | None:
    errors = extract(body, "error.errors")
    for e in errors if isinstance(errors, list) else []:
        found = extract(e, "links.conflicting_resource_id")
        if isinstance(found, str) and found:
            return found
    return None


# "Same key, different request" (or "the key already made something"): the provider holds a request
# under our key and refused this one because of it. Not "not executed": the request it holds is
# ours, sent earlier under the key (a worker that died before recording it, a person who said "not
# executed" wrongly, a definition changed since), and it may have taken effect. So ambiguous: the
# operation's lookup settles it (a person where the action declares none); never replayed (the
# same request gets the same answer); never failed_before_commit beside a real effect. A status
# the action's status_map maps to another class keeps that class (as for authority_statuses).
# Sources: /work/shared/PROVIDERS.md.
KEY_CONFLICTS: tuple[KeyConflict, ...] = (
    # Stripe: "Keys for idempotent requests can only be used with the same parameters they were first
    # used with". It keeps a key only once the endpoint began executing (a request that failed
    # validation stores nothing): the first request ran. stripe-python's IdempotencyError: 400 or 404.
    KeyConflict("stripe_idempotency_error", (400, 404), lambda b: extract(b, "error.type") == "idempotency_error"),
    # Our sandbox's answer to the same (workers/sandbox/idempotency.py): 409 by default, 400 as Stripe.
    KeyConflict("idempotency_error", (), lambda b: extract(b, "error.code") == "idempotency_error"),
    # Twilio 17534 "Idempotency key payload mismatch": the key, with another payload. Its status is
    # not documented: any 4xx.
    KeyConflict("twilio_17534_payload_mismatch", (), lambda b: str(extract(b, "code")) == "17534"),
    # GoCardless: 409 invalid_state "A resource has already been created with this idempotency key",
    # on any reuse after success, naming it (links.conflicting_resource_id): that object may be our
    # effect; the lookup (or the person) checks its fields.
    KeyConflict(
        "gocardless_idempotent_creation_conflict",
        (409,),
        lambda b: (
            extract(b, "error.type") == "invalid_state"
            and ("idempotent_creation_conflict" in _error_reasons(b) or _conflicting_resource(b) is not None)
        ),
        names_object=True,
    ),
)


def key_in_use(status_code: int, body: dict[str, Any] | None) -> bool:
    """A 409 saying an earlier request under this key is still running at the provider (Stripe's error
    code ``idempotency_key_in_use``, "currently being used in another request"; our sandbox's
    ``key_in_use``). This request was not processed, so not_processed (retried with backoff); the
    earlier one may still take effect, and its ambiguous or open attempt keeps failed_before_commit out
    of reach. Read as a rejection, it ended the operation failed_before_commit beside that effect."""
    if status_code != 409 or body is None:
        return False
    return extract(body, "error.code") in ("key_in_use", "idempotency_key_in_use")


def said_key_conflict(error: str | None) -> bool:
    """Whether an attempt's recorded error is a KEY_CONFLICTS answer (its reason, before the colon)."""
    reason = (error or "").split(":", 1)[0]
    return reason.startswith("http_") and any(reason.endswith("_" + row.answer) for row in KEY_CONFLICTS)


def key_conflict(status_code: int, body: dict[str, Any] | None) -> KeyConflict | None:
    """The row of KEY_CONFLICTS this 4xx answer matches, if any."""
    if body is None or not 400 <= status_code < 500:
        return None
    for row in KEY_CONFLICTS:
        if (not row.statuses or status_code in row.statuses) and row.matches(body):
            return row
    return None


class LocalValidationError(ValueError):
    """The request could not be built; nothing was sent.

    ``retryable``: False (the default) when the intent's own arguments break the action's contract:
    they never change, so every attempt would fail the same way and the operation ends at once.
    True when configuration an operator can fix while the operation waits is missing (a tenant's
    credentials): retried within the budget."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Classification:
    klass: AttemptClass
    reason: str
    status_code: int | None = None
    retry_after_s: float | None = None
    provider_reference: str | None = None
    provider_request_id: str | None = None
    body: dict[str, Any] | None = None
    # Where the failure happened: "local" (the request could not be built from the arguments:
    # our side, never the downstream's health), "transport" (no HTTP answer), "http" (an answer).
    origin: Literal["local", "transport", "http"] = "http"
    # The same request would fail the same way (arguments that break the action's contract): the
    # operation ends without spending its retry budget.
    final: bool = False
    # A 2xx whose status field says the provider failed it (the action's lookup.failed): the
    # provider took it and holds it as failed, which is not a rejection of the request.
    failed_at_provider: bool = False
    # A rejection whose status the target names in its authority_statuses: the provider refused our
    # credentials, not the intent. Still provably not executed; never retried blindly: a person.
    authority_refused: bool = False
    # The provider holds another request under our key (KEY_CONFLICTS): ambiguous, looked up, never
    # replayed.
    key_conflict: bool = False

    @property
    def provably_not_executed(self) -> bool:
        return self.klass in (A.NOT_SENT, A.NOT_PROCESSED, A.REJECTED)


@dataclass(frozen=True)
class Progress:
    """How a provider's answer says how far it got: the action's lookup.status_field and its lists
    (outbox.actions.specs.LookupSpec). A 2xx whose status is pending is accepted, not done."""

    status_field: str
    pending: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


def classify_exception(exc: BaseException) -> Classification:
    """Classify a failure raised while building or sending the request."""
    if isinstance(exc, LocalValidationError):
        return Classification(A.NOT_SENT, f"local_validation: {exc}", origin="local", final=not exc.retryable)
    for exc_type, klass, reason in _EXCEPTION_TABLE:
        if isinstance(exc, exc_type):
            return Classification(klass, reason, origin="transport")
    # Unknown failure mid-call (a bug, a new httpx error): assume the request may have left.
    return Classification(A.AMBIGUOUS, f"unexpected_error: {type(exc).__name__}", origin="transport")


def status_class(status_code: int, status_map: Mapping[int | str, AttemptClass] | None = None) -> AttemptClass:
    """The table lookup alone: action override, then default; exact code, then family."""
    family = f"{status_code // 100}xx"
    for table in (status_map or {}, DEFAULT_STATUS_MAP):
        if status_code in table:
            return table[status_code]
        if family in table:
            return table[family]
    return A.AMBIGUOUS  # outside 100-599: nothing proves anything


def classify_response(
    status_code: int,
    headers: Mapping[str, str] | httpx.Headers,
    body: bytes,
    *,
    result_reference: str | None = "id",
    status_map: Mapping[int | str, AttemptClass] | None = None,
    now: datetime | None = None,
    progress: Progress | None = None,
    authority_statuses: Collection[int] = (),
) -> Classification:
    """Classify a complete HTTP response.

    A success needs proof: a JSON object body carrying ``result_reference`` (dotted path).
    A truncated or empty 2xx is AMBIGUOUS, never success (FAULTS.md: proxies cut bodies).
    Accepted is not completed: a 202, or a 2xx whose ``progress.status_field`` is pending, is
    ACCEPTED (its reference kept if it has one); one whose status is failed is REJECTED with
    ``failed_at_provider`` (the provider took it and failed it). A rejection whose status is in
    ``authority_statuses`` (the target's) is ``authority_refused``: our credentials, not the intent,
    were refused. Only a rejection: an action that maps such a status to another class keeps it.
    A rejection that says the key was first used with another request (KEY_CONFLICTS) is AMBIGUOUS
    with ``key_conflict``: the provider holds a request under the key, which may have taken effect.
    """
    hdrs = headers if isinstance(headers, httpx.Headers) else httpx.Headers(headers)
    parsed = _parse_json(body)
    body_dict = parsed if isinstance(parsed, dict) else None
    # An HTTP-date Retry-After is on the provider's clock: read it against the same response's
    # Date header (RFC 9110 asks origin servers to send one), not against this worker's clock,
    # which may be minutes off. Without a Date header, ``now`` (or this worker's clock) it is. Read only
    # when there is a Retry-After: parsing a date was a visible share of every answer's classification.
    retry_after = hdrs.get("retry-after")
    retry_after_s = None
    if retry_after is not None:
        server_now = parse_http_date(hdrs["date"]) if "date" in hdrs else None
        retry_after_s = parse_retry_after(retry_after, server_now or now or datetime.now(UTC))
    request_id = next((hdrs[h] for h in _REQUEST_ID_HEADERS if h in hdrs), None)
    klass = status_class(status_code, status_map)

    def result(k: AttemptClass, reason: str, reference: str | None = None) -> Classification:
        return Classification(k, reason, status_code, retry_after_s, reference, request_id, body_dict)

    if klass is A.ACCEPTED:
        found = extract(body_dict, result_reference) if body_dict is not None and result_reference else None
        ref = None if found is None or isinstance(found, (dict, list, bool)) or str(found) == "" else str(found)
        return result(A.ACCEPTED, f"http_{status_code}_accepted", ref)
    if klass is A.REJECTED and (conflict := key_conflict(status_code, body_dict)) is not None:
        assert body_dict is not None
        ref = _conflicting_resource(body_dict) if conflict.names_object else None
        return replace(result(A.AMBIGUOUS, f"http_{status_code}_{conflict.answer}", ref), key_conflict=True)
    if klass is A.REJECTED and key_in_use(status_code, body_dict):
        return result(A.NOT_PROCESSED, f"http_{status_code}_key_in_use")
    if klass is A.REJECTED and status_code in authority_statuses:
        return replace(result(klass, f"http_{status_code}_authority_refused"), authority_refused=True)
    if klass is not A.SUCCEEDED:
        return result(klass, f"http_{status_code}")
    if body_dict is None:
        what = "empty" if not body.strip() else ("not a JSON object" if parsed is not _UNPARSEABLE else "unparseable")
        return result(A.AMBIGUOUS, f"http_{status_code}_body_{what.replace(' ', '_')}")
    reference = extract(body_dict, result_reference) if result_reference is not None else None
    said = extract(body_dict, progress.status_field) if progress is not None else None
    if isinstance(said, str) and progress is not None:
        ref = None if reference is None or isinstance(reference, (dict, list, bool)) else str(reference) or None
        if said in progress.pending:
            return result(A.ACCEPTED, f"http_{status_code}_{progress.status_field}_{said}", ref)
        if said in progress.failed:
            return replace(
                result(A.REJECTED, f"http_{status_code}_{progress.status_field}_{said}", ref), failed_at_provider=True
            )
    if result_reference is None:
        return result(A.SUCCEEDED, f"http_{status_code}")
    if reference is None or isinstance(reference, (dict, list, bool)) or str(reference) == "":
        return result(A.AMBIGUOUS, f"http_{status_code}_without_{result_reference}")
    return result(A.SUCCEEDED, f"http_{status_code}", str(reference))


_UNPARSEABLE = object()


def _parse_json(body: bytes) -> Any:
    if not body:
        return _UNPARSEABLE
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _UNPARSEABLE


def extract(obj: Any, dotted: str) -> Any:
    """``obj["a"]["b"]`` for ``"a.b"``; None when any step is missing."""
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj
