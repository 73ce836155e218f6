"""Webhooks, counted per target in the process that receives them (``agent-outbox serve``'s /metrics,
summed across its processes under PROMETHEUS_MULTIPROC_DIR as every process metric is):

- ``outbox_webhooks_received_total{target}``: every request to /v1/webhooks/<target>;
- ``outbox_webhooks_verified_total{target, disposition}``: signed with a secret of the endpoint,
  and what the ledger did with it (settled, recorded, no_operation, ambiguous, ignored, duplicate);
- ``outbox_webhooks_rejected_total{target, why}``: refused before anything was stored (malformed,
  stale, signature, endpoint: no such target or tenant endpoint).

``target`` is a target of the actions file, or "unknown" (a path that names none: never the path's
own text, which anyone can choose).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from workers.ground.metrics import PROCESS_REGISTRY

log = logging.getLogger(__name__)

RECEIVED = Counter(
    "outbox_webhooks_received", "Webhook requests received, by target", ["target"], registry=PROCESS_REGISTRY
)
VERIFIED = Counter(
    "outbox_webhooks_verified",
    "Webhook events verified, by target and what the ledger did with them",
    ["target", "disposition"],
    registry=PROCESS_REGISTRY,
)
REJECTED = Counter(
    "outbox_webhooks_rejected",
    "Webhook requests refused before anything was stored, by target and why",
    ["target", "why"],
    registry=PROCESS_REGISTRY,
)
KNOWN_WHY = frozenset({"malformed", "stale", "signature", "endpoint"})


def record(target: str | None, *, disposition: str | None = None, rejected: str | None = None) -> None:
    """One webhook request: verified (``disposition``) or refused (``rejected``). Never raises."""
    label = target or "unknown"
    try:
        RECEIVED.labels(label).inc()
        if rejected is not None:
            REJECTED.labels(label, rejected if rejected in KNOWN_WHY else "other").inc()
        elif disposition is not None:
            VERIFIED.labels(label, disposition).inc()
    except Exception:  # noqa: BLE001 - a metric must never fail the request
        log.warning("webhook metrics: recording failed", exc_info=True)
