"""A refund request: the application's row and the refund intent commit together, or neither does.

``POST /refunds`` with ``{"order_id", "amount", "currency", "reason"}`` writes a RefundRequest and
submits ``payments.refund.create`` inside one ``transaction.atomic()``. The relay hears of the intent
when that transaction commits, and a worker makes the refund once. The key is the business identity
(one refund per order): the same request again answers the same operation (200), the same order with
another amount is refused (409), never a second refund.

``POST /refunds/crash-after-submit`` does the same and then fails before the commit, as a bug or a
lost database connection would: the row and the intent roll back together, nothing is ever sent.
"""

from __future__ import annotations

import functools
import json
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from outbox.actions.rules import ActionRules, load_action_rules
from producer import IdempotencyConflict, InvalidIntent, Receipt
from producer import django as outbox
from refunds.models import RefundRequest


@functools.cache
def rules() -> ActionRules | None:
    """The actions file's provider keys and approval rules, read once (None: the defaults)."""
    return load_action_rules(settings.OUTBOX_ACTIONS_FILE) if settings.OUTBOX_ACTIONS_FILE else None


class CrashAfterSubmit(Exception):
    def __init__(self, operation_id: str) -> None:
        super().__init__(f"crashed after submitting operation {operation_id}, before the commit")
        self.operation_id = operation_id


def _refund_args(request: HttpRequest) -> dict[str, Any]:
    data = json.loads(request.body, parse_float=Decimal)  # 25.00 in the JSON stays 25.00
    return {
        "order_id": str(data["order_id"]),
        # Money as a decimal string ("25.00"): exact (binary floats are refused), and what the
        # action's `decimal_args` asks of it.
        "amount": str(Decimal(str(data["amount"]))),
        "currency": str(data["currency"]),
        "reason": str(data.get("reason", "")),
    }


def _record_and_submit(args: dict[str, Any]) -> tuple[RefundRequest, Receipt]:
    """Inside the caller's atomic(): the row, then the intent, in the same transaction."""
    key = f"refund:{args['order_id']}:v1"
    refund, _ = RefundRequest.objects.get_or_create(idempotency_key=key, defaults=args)
    receipt = outbox.submit(
        tenant=settings.OUTBOX_TENANT,
        idempotency_key=key,
        action="payments.refund.create",
        args=args,
        subject="django:refunds",
        rules=rules(),
    )
    if refund.operation_id != receipt.operation_id:
        refund.operation_id = receipt.operation_id
        refund.save(update_fields=["operation_id"])
    return refund, receipt


@require_POST
def request_refund(request: HttpRequest) -> JsonResponse:
    try:
        args = _refund_args(request)
        with transaction.atomic():
            refund, receipt = _record_and_submit(args)
    except (ValueError, KeyError, InvalidOperation) as exc:  # InvalidIntent is a ValueError
        field = exc.field if isinstance(exc, InvalidIntent) else None
        return JsonResponse({"error": str(exc), "field": field}, status=400)
    except IdempotencyConflict as exc:
        return JsonResponse({"error": str(exc), "operation_id": exc.operation_id}, status=409)
    body = {"refund_request": refund.pk} | receipt.as_dict()
    return JsonResponse(body, status=201 if receipt.new else 200)


@require_POST
def request_refund_then_crash(request: HttpRequest) -> JsonResponse:
    try:
        with transaction.atomic():
            _, receipt = _record_and_submit(_refund_args(request))
            raise CrashAfterSubmit(receipt.operation_id)
    except CrashAfterSubmit as crash:
        # atomic() rolled back: no RefundRequest, no operation, no NOTIFY; nothing will be sent.
        return JsonResponse({"error": str(crash), "rolled_back_operation_id": crash.operation_id}, status=500)
