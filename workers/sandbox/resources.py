"""The resources that change the world: refunds, tickets and emails (and, for runs, orders,
reservations, quotes, quote commits and cancellations).

Each spec validates a request body into parameters and builds the created object. Validation
failures are `Rejection`s carrying the HTTP status and a Stripe-shaped error.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from workers.sandbox.responses import error_body

# A positive decimal string with at most two places: "12", "12.5", "12.50"; not "1e3", "-1", "0".
_AMOUNT = re.compile(r"^\d{1,12}(\.\d{1,2})?$")
_CURRENCY = re.compile(r"^[A-Za-z]{3}$")
PRIORITIES = ("low", "normal", "high", "urgent")


class Rejection(Exception):
    """The provider refused the request as a business or validation error (nothing created)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body


def missing(param: str) -> Rejection:
    return Rejection(
        422,
        error_body("invalid_request_error", "parameter_missing", f"Missing required param: {param}.", param),
    )


def invalid(code: str, param: str, message: str) -> Rejection:
    return Rejection(422, error_body("invalid_request_error", code, message, param))


def over_limit(limit: Decimal) -> Rejection:
    return Rejection(
        402,
        error_body("request_failed", "amount_over_limit", f"Refund amount exceeds the limit of {limit}.", "amount"),
    )


def _required_str(body: dict[str, Any], param: str) -> str:
    value = body.get(param)
    if value is None or value == "":
        raise missing(param)
    if not isinstance(value, str):
        raise invalid("invalid_string", param, f"{param} must be a string.")
    return value


def _optional_str(body: dict[str, Any], param: str, default: str | None) -> str | None:
    value = body.get(param, default)
    if value is not None and not isinstance(value, str):
        raise invalid("invalid_string", param, f"{param} must be a string.")
    return value


def validate_refund(body: dict[str, Any], over_limit_amount: Decimal) -> dict[str, Any]:
    order_id = _required_str(body, "order_id")
    if "amount" not in body or body["amount"] in (None, ""):
        raise missing("amount")
    amount = body["amount"]
    # Amounts are decimal strings: a JSON float would already have lost cents.
    if not isinstance(amount, str) or not _AMOUNT.match(amount) or Decimal(amount) <= 0:
        raise invalid("invalid_amount", "amount", "amount must be a positive decimal string with at most 2 places.")
    currency = _required_str(body, "currency")
    if not _CURRENCY.match(currency):
        raise invalid("invalid_currency", "currency", "currency must be a 3-letter ISO code.")
    reason = _optional_str(body, "reason", None)
    if Decimal(amount) > over_limit_amount:
        raise over_limit(over_limit_amount)
    return {"order_id": order_id, "amount": amount, "currency": currency.lower(), "reason": reason}


def validate_ticket(body: dict[str, Any], over_limit_amount: Decimal) -> dict[str, Any]:
    subject = _required_str(body, "subject")
    customer_id = _required_str(body, "customer_id")
    text = _optional_str(body, "body", "")
    priority = _optional_str(body, "priority", "normal")
    if priority not in PRIORITIES:
        raise invalid("invalid_priority", "priority", f"priority must be one of {', '.join(PRIORITIES)}.")
    return {"subject": subject, "body": text, "priority": priority, "customer_id": customer_id}


def validate_email(body: dict[str, Any], over_limit_amount: Decimal) -> dict[str, Any]:
    to = _required_str(body, "to")
    if "@" not in to:
        raise invalid("invalid_email", "to", "to must be an email address.")
    subject = _required_str(body, "subject")
    text = _optional_str(body, "body", "")
    return {"to": to, "subject": subject, "body": text}


_RESERVED = frozenset({"id", "object", "status", "idempotency_key", "created"})


def requiring(*params: str) -> Callable[[dict[str, Any], Decimal], dict[str, Any]]:
    """A plain resource: these string params are required, any other field is kept as given."""

    def validate(body: dict[str, Any], over_limit_amount: Decimal) -> dict[str, Any]:
        kept = {k: v for k, v in body.items() if k not in _RESERVED}
        return {**kept, **{p: _required_str(body, p) for p in params}}

    return validate


@dataclass(frozen=True)
class ResourceSpec:
    """What differs between resources: URL name, id prefix, object name, statuses, validation."""

    name: str  # URL segment: /v1/<name>
    object: str
    id_prefix: str
    final_status: str  # status once processed ("pending" before, when processing is on)
    validate: Callable[[dict[str, Any], Decimal], dict[str, Any]]

    def new_id(self) -> str:
        return f"{self.id_prefix}_{secrets.token_hex(12)}"


RESOURCES: dict[str, ResourceSpec] = {
    spec.name: spec
    for spec in (
        ResourceSpec("refunds", "refund", "re", "succeeded", validate_refund),
        ResourceSpec("tickets", "ticket", "tk", "open", validate_ticket),
        ResourceSpec("emails", "email", "em", "sent", validate_email),
        # For multi-step runs (agent-outbox runs): an order placed, stock held, a quote drafted and
        # committed, and a cancellation that undoes any of them (a compensation).
        ResourceSpec("orders", "order", "or", "placed", requiring("order_ref")),
        ResourceSpec("reservations", "reservation", "rs", "held", requiring("sku")),
        ResourceSpec("quotes", "quote", "qt", "draft", requiring("quote_ref")),
        ResourceSpec("quote_commits", "quote_commit", "qc", "committed", requiring("quote_ref")),
        ResourceSpec("cancellations", "cancellation", "cx", "done", requiring("undoes")),
    )
}
