"""The values a breaker store hands back: decisions, results of recording, snapshots.

State names are pybreaker's (``closed``, ``open``, ``half-open``) so logs, the CLI and
pybreaker listeners use the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pybreaker import STATE_CLOSED, STATE_HALF_OPEN, STATE_OPEN

StateName = Literal["closed", "open", "half-open"]
StorageKind = Literal["redis", "local", "degraded"]

__all__ = [
    "STATE_CLOSED",
    "STATE_HALF_OPEN",
    "STATE_OPEN",
    "Allowed",
    "Open",
    "Decision",
    "Admission",
    "Recorded",
    "Snapshot",
    "BreakerStatus",
    "from_ms",
]


def from_ms(epoch_ms: int | None) -> datetime | None:
    if epoch_ms is None:
        return None
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)


@dataclass(frozen=True)
class Allowed:
    """Send exactly one attempt, then hand this back to ``BreakerRegistry.record``.

    probe: this attempt is the single half-open probe (across all processes).
    storage/probe_token route the result to the store that admitted it.
    """

    target: str
    probe: bool
    storage: Literal["redis", "local"]
    probe_token: str | None = None


@dataclass(frozen=True)
class Open:
    """Do not send: the attempt is ``not_sent``; reschedule ``wait_s`` from now.

    reopens_at is opened_at + reset_timeout_s while open, or now + probe_wait_s while
    another caller holds the half-open probe, on the breaker store's clock (Redis server time
    when shared); ``wait_s`` is the same moment measured on that clock, so a caller whose own
    clock is off still waits the right time (add it to the ledger's clock, never compare
    reopens_at with a worker's wall clock).
    """

    target: str
    reopens_at: datetime
    storage: Literal["redis", "local"]
    wait_s: float = 0.0


Decision = Allowed | Open


@dataclass(frozen=True)
class Admission:
    """What a store answered to ``admit``: a decision plus the transition it made, if any."""

    allowed: bool
    probe_token: str | None
    reopens_at_ms: int | None
    transition: StateName | None
    failures: int
    now_ms: int = 0  # the store's clock when it answered (reopens_at_ms is on the same clock)

    def wait_s(self) -> float:
        return max((self.reopens_at_ms or 0) - self.now_ms, 0) / 1000


@dataclass(frozen=True)
class Recorded:
    """What a store did with one recorded result."""

    state: StateName
    transition: StateName | None
    failures: int
    successes: int


@dataclass(frozen=True)
class Snapshot:
    state: StateName
    failures: int
    successes: int
    opened_at_ms: int | None
    reopens_at_ms: int | None
    probing: bool


@dataclass(frozen=True)
class BreakerStatus:
    """One row of ``breaker status``: what operators see."""

    target: str
    state: StateName
    failures: int
    opened_at: datetime | None
    reopens_at: datetime | None
    storage: StorageKind
