"""Breaker state per target as a prometheus_client collector, read from Redis at scrape time.

``outbox_breaker_state{target}``: 0 closed, 1 half-open, 2 open (the shared state every worker
sees). Only with a Redis URL: process-local breakers live in each worker's memory and an exporter
cannot see them, so it shows nothing rather than a made-up "closed" (as ``breaker status`` does).
Redis unreachable: no samples, ``outbox_breaker_storage_up 0`` and one WARNING until it is back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from breaker.errors import BreakerStorageUnavailable
from breaker.operator import status

log = logging.getLogger(__name__)

STATE_VALUE = {"closed": 0, "half-open": 1, "open": 2}


class BreakerCollector(Collector):
    def __init__(self, redis_url: str, targets: Sequence[str], namespace: str = "default") -> None:
        self.redis_url = redis_url
        self.targets = sorted(targets)
        self.namespace = namespace
        self._warned = False

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing is read at registration time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("outbox_breaker_storage_up", "1 if the shared breaker state (Redis) was read, else 0")
        state = GaugeMetricFamily(
            "outbox_breaker_state", "Circuit breaker per target: 0 closed, 1 half-open, 2 open", labels=["target"]
        )
        try:
            rows = status(self.redis_url, self.targets, self.namespace) if self.targets else []
        except BreakerStorageUnavailable as exc:
            if not self._warned:
                log.warning("metrics: breaker storage unreachable; no breaker states", extra={"error": str(exc)})
            self._warned = True
            up.add_metric([], 0)
            yield up
            return
        self._warned = False
        up.add_metric([], 1)
        for row in rows:
            if row.state in STATE_VALUE:
                state.add_metric([row.target], STATE_VALUE[row.state])
        yield up
        yield state
