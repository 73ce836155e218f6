"""Late successes found by a process of the pipeline: a worker's own refused 2xx, or those the
reconciler finds on its operation before it asks the provider. Evidence wins (outbox/evidence/late_successes.py).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.evidence.late_successes import apply_unapplied
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.states import Status
from workers.engine import call_events
from workers.engine.handoff_packet import packet_builder
from workers.ground import metrics
from workers.provider.actions import ActionsFile

log = logging.getLogger(__name__)


def apply_late_successes(
    sessions: sessionmaker[Session],
    *,
    actor: str,
    evidence: EvidenceSink,
    actions: ActionsFile,
    attempt_results: dict[int, dict[str, Any] | None] | None = None,
    operation_ids: list[str] | None = None,
) -> dict[str, Status]:
    """Settle operations by late successes: the given attempts' (a worker's own, with the response
    bodies it read), or any of ``operation_ids``'. Never raises: the relay's sweep is the backstop."""
    try:
        moved = apply_unapplied(
            sessions,
            actor=actor,
            sink=evidence,
            packet=packet_builder(actions),
            attempt_ids=list(attempt_results) if attempt_results is not None else None,
            operation_ids=operation_ids,
            results={k: v for k, v in (attempt_results or {}).items() if v is not None},
        )
    except Exception:  # noqa: BLE001 - the evidence is committed; the sweep applies it later
        log.warning("applying late evidence failed; the relay's sweep will", exc_info=True)
        return {}
    for status in moved.values():
        metrics.record_outcome(status)
    call_events.late_successes(moved)
    return moved
