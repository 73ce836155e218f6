"""Runtime settings of the sandbox and its clock."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from decimal import Decimal, InvalidOperation
from typing import Any


class SettingError(ValueError):
    """A settings update named an unknown field or gave a bad value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class SandboxConfig:
    """Settings that tests change at run time through `POST /admin/config`."""

    idempotency: bool = True
    # A request under a known key whose method, path, query or body differ from the first one's is
    # refused (error code idempotency_error), as Stripe does. On by default: the careful provider is
    # the sandbox's default, and an error is how a test sees that a retry was not the first request
    # (a replayed answer would hide it). Off: a provider that does not compare, which replays the
    # first answer whatever the later request says (the contract fault accept_changed_args, for
    # every key). The status: 409 (the sandbox's default) or 400 (exactly Stripe's).
    compare_params: bool = True
    params_mismatch_status: int = 409
    # Stripe prunes keys "after they're at least 24 hours old"; we keep exactly that by default.
    retention_s: float = 86400.0
    # Search indexes of real providers lag their primary store; 0 means lookups see writes at once.
    index_lag_s: float = 0.0
    strict_fencing: bool = False
    # Refunds above this amount are refused with 402 (a business limit, not a validation error).
    over_limit_amount: Decimal = Decimal("10000.00")
    # >0: objects are created "pending" and read as settled once this much time has passed.
    processing_s: float = 0.0
    # The creation's status code while processing is on: 200 (a body saying "pending") or 202.
    processing_status: int = 200
    # Objects whose idempotency key matches this glob end "failed" instead (a payout accepted at
    # 10:00 that fails at 10:05); empty: none fails. Only with processing_s > 0.
    processing_fails: str = ""
    # Bounds memory in long benchmarks; the oldest request-log entries are dropped first.
    request_log_max: int = 100_000
    # Signed webhooks (webhooks.py): an event on each object's creation and when a pending one
    # settles, POSTed to this URL ("{tenant}" is the object's tenant); empty: none are sent.
    webhook_url: str = ""
    webhook_scheme: str = "standard"  # "standard" (Standard Webhooks) or "stripe" (Stripe-Signature)
    webhook_secret: str = ""
    webhook_secrets: dict[str, str] = field(default_factory=dict)  # a tenant's own, over webhook_secret
    # True: events wait in the sandbox until POST /admin/webhooks/release (a test decides when they land).
    webhooks_held: bool = False

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["over_limit_amount"] = str(self.over_limit_amount)
        return data

    def update(self, changes: dict[str, Any]) -> None:
        """Validate every change first, then apply them all (no half-applied update)."""
        known = {f.name: f for f in fields(self)}
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in known:
                raise SettingError(name, "unknown setting")
            parsed[name] = _parse(name, value)
        for name, value in parsed.items():
            setattr(self, name, value)


def _parse(name: str, value: Any) -> Any:
    if name == "params_mismatch_status":
        if value not in (400, 409):
            raise SettingError(name, "must be 400 (as Stripe answers) or 409")
        return value
    if name in ("idempotency", "strict_fencing", "webhooks_held", "compare_params"):
        if not isinstance(value, bool):
            raise SettingError(name, "must be true or false")
        return value
    if name == "over_limit_amount":
        try:
            amount = Decimal(str(value))
        except InvalidOperation as exc:
            raise SettingError(name, "must be a decimal") from exc
        if not amount.is_finite() or amount <= 0:
            raise SettingError(name, "must be a positive decimal")
        return amount
    if name == "processing_status":
        if value not in (200, 201, 202):
            raise SettingError(name, "must be 200, 201 or 202")
        return value
    if name == "webhook_scheme":
        if value not in ("standard", "stripe"):
            raise SettingError(name, "must be 'standard' or 'stripe'")
        return value
    if name in ("webhook_url", "webhook_secret"):
        if not isinstance(value, str):
            raise SettingError(name, "must be a string (empty: none)")
        return value
    if name == "webhook_secrets":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise SettingError(name, "must be an object of tenant -> secret")
        return dict(value)
    if name == "processing_fails":
        if not isinstance(value, str):
            raise SettingError(name, "must be a glob of idempotency keys (or empty)")
        return value
    if name == "request_log_max":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SettingError(name, "must be a positive integer")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SettingError(name, "must be a number >= 0")
    return float(value)


class Clock:
    """Wall time plus an offset, so tests can jump past a 24 h retention without waiting.

    Object times, key retention, index lag and processing use this clock. The request log uses
    the real wall clock because tests compare it with their own clients' clocks (Retry-After).
    """

    def __init__(self) -> None:
        self.offset_s = 0.0

    def now(self) -> float:
        return time.time() + self.offset_s

    def advance(self, seconds: float) -> None:
        self.offset_s += seconds
