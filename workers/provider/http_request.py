"""Building one downstream request from an action and its arguments, and its digest.

Pure: no I/O. Anything wrong with the arguments raises LocalValidationError, which the failure
table classes as not_sent (nothing left the machine).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import quote, urlsplit

from outbox.actions.matching import placeholders
from outbox.actions.specs import RequestSpec
from outbox.errors import InvalidIntent
from outbox.ledger.envelope import canonical_value, dumps_canonical
from workers.provider.classify import LocalValidationError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Money as a decimal string: a JSON float would already have lost cents.
_DECIMAL = re.compile(r"^-?\d+(\.\d+)?$")
_QUERY_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class PreparedRequest:
    method: str
    path: str  # placeholders filled and URL-quoted, relative to the target's base_url
    query: dict[str, Any] = field(default_factory=dict)
    body: bytes | None = None  # canonical JSON, exactly the bytes sent
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SentRequest:
    """What one attempt put on the wire, as an operation records it (outbox/ledger/request_record.py):
    the method, the path and query as encoded, relative to the target's base_url, the body, the digest."""

    method: str
    path: str
    body: bytes | None
    digest: str


@functools.lru_cache(maxsize=64)
def _base_path(base_url: str) -> str:
    return urlsplit(base_url).path.rstrip("/")


def relative_path(raw_path: bytes, base_url: str) -> str:
    """A request's path and query as sent (httpx's ``url.raw_path``), without ``base_url``'s own path."""
    path = raw_path.decode("ascii")
    base = _base_path(base_url)
    return path[len(base) :] if base and path.startswith(base) else path


def recorded_request(method: str, path: str, body: str | None) -> PreparedRequest:
    """The request on record, to be sent again as it is (its query is part of ``path``)."""
    data = body.encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    return PreparedRequest(method, path, {}, data, headers)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, no NaN: the same arguments always give the same bytes."""
    try:
        # The ledger's canonical form: exact decimals stay exact on the wire.
        return dumps_canonical(canonical_value(value)).encode()
    except (InvalidIntent, TypeError, ValueError) as exc:
        raise LocalValidationError(f"arguments are not JSON-serialisable: {exc}") from exc


def request_digest(method: str, url: str, body: bytes | None) -> str:
    """sha256 of what was sent (method, full URL with query, canonical body); headers excluded
    because the fencing token changes per attempt while the request's meaning does not."""
    h = hashlib.sha256()
    h.update(method.upper().encode())
    h.update(b"\n")
    h.update(url.encode())
    h.update(b"\n")
    h.update(body or b"")
    return h.hexdigest()


def check_decimal_args(args: Mapping[str, Any], decimal_args: list[str]) -> dict[str, Any]:
    """Decimal strings pass; a Decimal or a whole number becomes its decimal string; anything else
    (a bool, a list, garbage text) is refused. Whole numbers pass because the ledger canonicalises
    numbers by value: ``Decimal("25.00")`` is stored as 25, and refusing it made a whole amount fail
    where 12.50 went through. (Floats never get here: submit refuses them.)"""
    out = dict(args)
    for name in decimal_args:
        if name not in out or out[name] is None:
            continue
        value = out[name]
        if isinstance(value, Decimal):
            if not value.is_finite():
                raise LocalValidationError(f"{name} must be a finite decimal, got {value}")
            out[name] = format(value, "f")
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = str(value)
        elif isinstance(value, bool) or not isinstance(value, str):
            raise LocalValidationError(f"{name} is money and must be a decimal string, got {type(value).__name__}")
        elif not _DECIMAL.match(value):
            raise LocalValidationError(f"{name} must be a decimal string like '12.50', got {value!r}")
    return out


def fill(template: str, values: Mapping[str, Any], *, quote_values: bool) -> str:
    missing = placeholders(template) - set(values)
    if missing:
        raise LocalValidationError(f"missing argument(s) {sorted(missing)} for {template!r}")

    def render(value: Any) -> str:
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (str, int, float, Decimal)):
            text = str(value)
        else:
            raise LocalValidationError(f"a {type(value).__name__} cannot fill a placeholder in {template!r}")
        # safe="": a "/" inside an argument must not become a path segment of its own.
        return quote(text, safe="") if quote_values else text

    return template.format_map({k: render(values[k]) for k in placeholders(template)})


def prepare(
    spec: RequestSpec,
    args: Mapping[str, Any],
    *,
    idempotency_key: str,
    decimal_args: list[str] | None = None,
    send_rest: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> PreparedRequest:
    """Fill ``spec`` from ``args``; placeholders consume their argument, the rest is the JSON
    body (POST/PUT/PATCH) or the query (GET/DELETE). ``send_rest=False`` sends only the
    templated fields (lookups). ``extra`` supplies non-argument placeholders (since, cursor)."""
    checked = check_decimal_args(args, decimal_args or [])
    values: dict[str, Any] = {**checked, "idempotency_key": idempotency_key, **(extra or {})}
    path = fill(spec.path, values, quote_values=True)
    query = {name: fill(template, values, quote_values=False) for name, template in spec.query.items()}
    used = spec.placeholder_names()
    rest = {k: v for k, v in checked.items() if k not in used} if send_rest else {}
    body: bytes | None = None
    if spec.method in BODY_METHODS:
        body = canonical_json(rest)
    else:
        for name, value in sorted(rest.items()):
            if value is None:
                continue
            ok = isinstance(value, _QUERY_SCALARS) or (
                isinstance(value, list) and all(isinstance(v, _QUERY_SCALARS) for v in value)
            )
            if not ok:
                raise LocalValidationError(f"argument {name} cannot be sent in a query string")
            query.setdefault(name, value)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    return PreparedRequest(spec.method, path, query, body, headers)
