"""The committer: what writing a call's or a lookup's result to the ledger takes (the worker's hot-path
connection and sessions, the evidence sink, the doorbell for what follows, the actions file), and
the late successes either may find on the way (evidence wins: outbox/evidence/late_successes.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.evidence.sinks import EvidenceSink
from outbox.ledger.hot_path import LedgerConnection
from outbox.ledger.states import Status
from workers.engine.doorbell import Doorbell
from workers.engine.late_successes import apply_late_successes
from workers.provider.actions import ActionsFile


@dataclass(frozen=True)
class Committer:
    """What writing results takes: the worker's hot-path connection and sessions, the evidence sink,
    the doorbell for what follows, and (for late successes' handoff packets) the actions file."""

    ledger: LedgerConnection
    sessions: sessionmaker[Session]
    evidence: EvidenceSink
    doorbell: Doorbell
    worker_id: str
    actions: ActionsFile

    def late_successes(
        self,
        *,
        attempt_results: dict[int, dict[str, Any] | None] | None = None,
        operation_ids: list[str] | None = None,
    ) -> dict[str, Status]:
        """Settle operations by the late successes on record: the given attempts' (a worker's own
        refused 2xx, with the response bodies it read), or any of ``operation_ids``'. Never raises."""
        return apply_late_successes(
            self.sessions,
            actor=self.worker_id,
            evidence=self.evidence,
            actions=self.actions,
            attempt_results=attempt_results,
            operation_ids=operation_ids,
        )
