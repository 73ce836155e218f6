"""Webhook signatures: Standard Webhooks and Stripe's ``Stripe-Signature``. The signature is the
authentication of ``POST /v1/webhooks/<target>``; nothing is stored for a request it does not pass.

- Standard Webhooks (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``): HMAC-SHA256 of
  ``{id}.{timestamp}.{raw body}`` keyed by the base64 after ``whsec_``, checked by the
  ``standardwebhooks`` package. The id is the event's id (the same on every retry of one event).
- Stripe (``Stripe-Signature: t=<unix s>,v1=<hex>[,v1=...]``): HMAC-SHA256 hex of ``{t}.{raw body}``
  keyed by the whole ``whsec_...`` string; any ``v1`` may match (other schemes are ignored). The
  event's id is the body's ``id``.

Several secrets may verify (a rotation: the new one and the old one). A timestamp outside the
tolerance (5 minutes: both ways for Standard Webhooks, as its library checks; only older for
Stripe, as its SDK checks) or a malformed request is answered 400, a signature that matches no
secret 401. The timestamp is checked before the signature: it needs no secret.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Both schemes' published default (Standard Webhooks' Python library, Stripe's SDK DEFAULT_TOLERANCE):
# long enough for a provider's queue and clock skew, short enough that a captured request cannot be
# replayed for long (a replay inside it finds the event's id kept, and changes nothing).
TOLERANCE_S = 300


class WebhookRefused(Exception):
    """The request is not a verified event: nothing is stored. ``status``: 400 or 401; ``why``: a
    word for the metrics (malformed, stale, signature)."""

    def __init__(self, status: int, why: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.why, self.detail = status, why, detail


@dataclass(frozen=True)
class Verified:
    event_id: str
    signed_at: dt.datetime
    payload: dict[str, Any]


def verify(scheme: str, secrets: Sequence[str], headers: Mapping[str, str], body: bytes, *, now_s: float) -> Verified:
    """The event, if one of ``secrets`` signed ``body`` under ``scheme``; WebhookRefused otherwise."""
    lowered = {k.lower(): v for k, v in headers.items()}
    if scheme == "standard":
        return _standard(secrets, lowered, body, now_s)
    if scheme == "stripe":
        return _stripe(secrets, lowered, body, now_s)
    raise ValueError(f"unknown webhook scheme {scheme!r}")


def _timestamp(raw: str, header: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise WebhookRefused(400, "malformed", f"{header} is not a Unix time in seconds") from None


def _stale(signed: int, now_s: float, *, both_ways: bool) -> None:
    age_s = now_s - signed
    if age_s > TOLERANCE_S or (both_ways and -age_s > TOLERANCE_S):
        raise WebhookRefused(
            400,
            "stale",
            f"signed {abs(age_s):.0f}s {'ago' if age_s > 0 else 'ahead'}: outside the {TOLERANCE_S}s tolerance",
        )


def _payload(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise WebhookRefused(400, "malformed", "the body is not JSON") from None
    if not isinstance(payload, dict):
        raise WebhookRefused(400, "malformed", "the body is not a JSON object")
    return payload


def _standard(secrets: Sequence[str], headers: Mapping[str, str], body: bytes, now_s: float) -> Verified:
    from standardwebhooks.webhooks import Webhook

    missing = [h for h in ("webhook-id", "webhook-timestamp", "webhook-signature") if not headers.get(h)]
    if missing:
        raise WebhookRefused(400, "malformed", f"missing {', '.join(missing)} (Standard Webhooks)")
    signed = _timestamp(headers["webhook-timestamp"], "webhook-timestamp")
    _stale(signed, now_s, both_ways=True)
    # The library signs; we compare. Its verify() would judge the timestamp again on the wall clock,
    # and ``now_s`` must be the only judge (a stored event is checked at the time it arrived).
    offered = [sig.partition(",")[2].encode() for sig in headers["webhook-signature"].split() if sig.startswith("v1,")]
    for secret in secrets:
        expected = Webhook(secret).sign(headers["webhook-id"], _at(signed), body).partition(",")[2].encode()
        if any(hmac.compare_digest(expected, sig) for sig in offered):
            return Verified(headers["webhook-id"], _at(signed), _payload(body))
    raise WebhookRefused(401, "signature", "no webhook-signature matches this endpoint's secret")


def _stripe(secrets: Sequence[str], headers: Mapping[str, str], body: bytes, now_s: float) -> Verified:
    header = headers.get("stripe-signature")
    if not header:
        raise WebhookRefused(400, "malformed", "missing Stripe-Signature")
    pairs = [item.split("=", 1) for item in header.split(",") if "=" in item]
    stamps = [v.strip() for k, v in pairs if k.strip() == "t"]
    given = [v.strip() for k, v in pairs if k.strip() == "v1"]
    if len(stamps) != 1 or not given:
        raise WebhookRefused(400, "malformed", "Stripe-Signature needs one t= and at least one v1=")
    signed = _timestamp(stamps[0], "Stripe-Signature t")
    _stale(signed, now_s, both_ways=False)
    message = f"{signed}.".encode() + body
    for secret in secrets:
        expected = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
        if any(hmac.compare_digest(expected, v) for v in given):
            payload = _payload(body)
            event_id = payload.get("id")
            if not isinstance(event_id, str) or not event_id:
                raise WebhookRefused(400, "malformed", "the event has no id")
            return Verified(event_id, _at(signed), payload)
    raise WebhookRefused(401, "signature", "no v1 signature matches this endpoint's secret")


def _at(epoch_s: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)
