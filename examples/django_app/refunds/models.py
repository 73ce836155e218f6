from django.db import models


class RefundRequest(models.Model):
    """The application's own row: a customer's refund request, one per order."""

    order_id = models.CharField(max_length=64)
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    currency = models.CharField(max_length=3)
    reason = models.CharField(max_length=200, blank=True)
    idempotency_key = models.CharField(max_length=255, unique=True)
    operation_id = models.CharField(max_length=36, blank=True)  # the outbox's operation
    created_at = models.DateTimeField(auto_now_add=True)
