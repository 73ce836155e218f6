"""The doorbell: a broker message that says only "operation X may be due".

It carries the operation id and nothing else (no arguments, no keys: Flower and the broker never
see business data). Losing one is harmless (the relay re-publishes after republish_after_s);
ringing twice is harmless (the second finds nothing to claim).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from celery import Celery

from workers.celery_app import DISPATCH_QUEUE, DISPATCH_TASK, RECONCILE_TASK, UNKNOWN_QUEUE

log = logging.getLogger(__name__)


@dataclass
class Doorbell:
    app: Celery

    @classmethod
    def from_current_app(cls) -> "Doorbell":
        from workers.tasks import app

        return cls(app)

    def ring_dispatch(self, operation_ids: Iterable[str]) -> int:
        return self._ring(DISPATCH_TASK, DISPATCH_QUEUE, operation_ids)

    def ring_reconcile(self, operation_ids: Iterable[str]) -> int:
        return self._ring(RECONCILE_TASK, UNKNOWN_QUEUE, operation_ids)

    def _ring(self, task: str, queue: str, operation_ids: Iterable[str]) -> int:
        n = 0
        with self.app.producer_or_acquire() as producer:
            for op_id in operation_ids:
                self.app.send_task(task, args=[op_id], queue=queue, producer=producer)
                n += 1
        return n
