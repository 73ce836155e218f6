"""The canonical envelope of an intent and its sha256 digest.

Same idempotency key + same digest = the same intent (a replay); same key + different digest is an
``IdempotencyConflict``. The digest must therefore not change with key order, whitespace or the
way a number was written, and money must never pass through a binary float.

Decision on numbers (documented in docs/how-to/submit.md):
- JSON text (CLI ``--args``, ``--jsonl``) is parsed with every number as an exact ``Decimal``;
- Python ``float`` values are REFUSED with an error naming the field: a float such as 0.1 is not
  the decimal the caller meant, and silently rounding money is how two systems come to disagree.
  Pass ``Decimal("10.50")`` or the string ``"10.50"``;
- numbers are canonicalised by value: ``100``, ``100.0`` and ``1E+2`` are the same number and are
  written ``100``; ``10.50`` is written ``10.5``. Strings are opaque: ``"10.50"`` stays ``"10.50"``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from outbox.errors import InvalidIntent

MAX_ARGS_BYTES = 256 * 1024  # an intent is a command, not a document store
MAX_DEPTH = 32
# No amount or identifier needs more digits; the bound keeps hostile input such as 1E+100000000
# from costing minutes (and gigabytes) to canonicalise.
MAX_NUMBER_DIGITS = 1000


@dataclass(frozen=True)
class Envelope:
    tenant: str
    action: str
    args: dict[str, Any]
    subject: str
    canonical_args: str
    digest: str


def loads_exact(text: str, *, field: str = "args") -> Any:
    """Parse JSON text with every number as an exact Decimal (never a binary float)."""
    try:
        return json.loads(text, parse_float=Decimal, parse_int=int, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise InvalidIntent(field, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except InvalidIntent:
        raise
    except ValueError as exc:  # an integer literal longer than Python's int conversion limit
        raise InvalidIntent(field, f"a number longer than {MAX_NUMBER_DIGITS} digits") from exc


def _refuse_constant(name: str) -> Any:
    raise InvalidIntent("args", f"{name} is not a number that can be stored exactly")


def canonical_value(value: Any, path: str = "args", depth: int = 0) -> Any:
    """Validate and normalise one JSON value; raises InvalidIntent naming the path."""
    if depth > MAX_DEPTH:
        raise InvalidIntent(path, f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if value.bit_length() > MAX_NUMBER_DIGITS * 10 // 3:  # ~ MAX_NUMBER_DIGITS decimal digits
            raise InvalidIntent(path, f"a number longer than {MAX_NUMBER_DIGITS} digits")
        return value
    if isinstance(value, float):
        hint = "" if not math.isfinite(value) else f" {value!r}"
        raise InvalidIntent(
            path,
            f"binary float{hint} cannot carry an exact amount; pass a string such as "
            f'"{value}" or decimal.Decimal("{value}")',
        )
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise InvalidIntent(path, f"{value} is not a finite number")
        if value and abs(value.adjusted()) > MAX_NUMBER_DIGITS:
            raise InvalidIntent(path, f"a number longer than {MAX_NUMBER_DIGITS} digits")
        return _normal_decimal(value)
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidIntent(path, f"object keys must be strings, got {type(key).__name__}")
            out[key] = canonical_value(item, f"{path}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [canonical_value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise InvalidIntent(path, f"{type(value).__name__} is not a JSON value")


def _normal_decimal(value: Decimal) -> int | Decimal:
    if value == value.to_integral_value():
        return int(value)
    try:
        return value.normalize()
    except InvalidOperation as exc:  # pragma: no cover - finite decimals always normalise
        raise InvalidIntent("args", f"cannot normalise {value}") from exc


# What json.dumps(text, ensure_ascii=False) writes for a string (its C encoder where there is one),
# without building a JSONEncoder per call: an intent's canonical text is written on every submit.
_json_string: Callable[[str], str] = json.encoder.encode_basestring


def dumps_canonical(value: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 text, decimals written exactly. Byte for
    byte what json.dumps(..., ensure_ascii=False) writes for each scalar (stored digests depend on it:
    tests/unit/test_envelope.py pins one)."""
    if isinstance(value, str):
        return _json_string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        items = sorted(value.items())
        return "{" + ",".join(_json_key(k) + ":" + dumps_canonical(v) for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps_canonical(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _json_key(key: Any) -> str:
    return _json_string(key) if isinstance(key, str) else json.dumps(key, ensure_ascii=False)


def _require_text(field: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidIntent(field, "required: a non-empty string")
    if value != value.strip():
        raise InvalidIntent(field, "must not start or end with whitespace")
    if len(value) > max_len:
        raise InvalidIntent(field, f"longer than {max_len} characters")
    return value


def build_envelope(*, tenant: Any, action: Any, args: Any, subject: Any) -> Envelope:
    """Validate an intent and compute its canonical form and digest."""
    tenant = _require_text("tenant", tenant, 128)
    action = _require_text("action", action, 200)
    if len(action.split(maxsplit=1)) > 1:  # whitespace inside (str.split's is str.isspace's)
        raise InvalidIntent("action", "must not contain whitespace (e.g. payments.refund.create)")
    subject = _require_text("subject", subject, 255)
    if not isinstance(args, dict):
        raise InvalidIntent("args", f"must be a JSON object, got {type(args).__name__}")
    canonical = canonical_value(args)
    canonical_args = dumps_canonical(canonical)
    try:
        size = len(canonical_args.encode())
    except UnicodeEncodeError:
        raise InvalidIntent("args", "must be valid Unicode text (a string or key holds a lone surrogate)") from None
    if size > MAX_ARGS_BYTES:
        raise InvalidIntent("args", f"larger than {MAX_ARGS_BYTES} bytes once canonicalised")
    # dumps_canonical({"tenant": ..., "action": ..., "args": canonical, "subject": ...}), its keys in
    # order, around the args' text already written.
    whole = (
        f'{{"action":{_json_string(action)},"args":{canonical_args},'
        f'"subject":{_json_string(subject)},"tenant":{_json_string(tenant)}}}'
    )
    digest = hashlib.sha256(whole.encode()).hexdigest()
    return Envelope(tenant, action, canonical, subject, canonical_args, digest)


def digest_of(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()
