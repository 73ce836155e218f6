"""Per-target breaker configuration and the one rule for what counts as a failure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BreakerConfig:
    """How one target's breaker trips and recovers.

    fail_max: consecutive counted failures (across all processes) that open the breaker.
    reset_timeout_s: how long it stays open before one probe is let through.
    success_threshold: consecutive probe successes needed to close it again (pybreaker's
        default of 1 closes on the first good probe).
    probe_timeout_s: lifetime of the cross-process probe lock. It must outlast one HTTP
        attempt (connect + read timeouts); if the prober dies without recording, the lock
        expires and the next caller probes instead of the breaker staying half-open forever.
    probe_wait_s: delay handed to callers that find another process probing; short, because
        the probe usually answers within one attempt's latency.
    """

    fail_max: int
    reset_timeout_s: float
    success_threshold: int = 1
    probe_timeout_s: float = 60.0
    probe_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.fail_max < 1:
            raise ValueError("fail_max must be >= 1")
        if self.reset_timeout_s <= 0:
            raise ValueError("reset_timeout_s must be > 0")
        if self.success_threshold < 1:
            raise ValueError("success_threshold must be >= 1")
        if self.probe_timeout_s <= 0 or self.probe_wait_s <= 0:
            raise ValueError("probe_timeout_s and probe_wait_s must be > 0")


def counts_as_failure(status_code: int | None, transport_error: bool) -> bool:
    """Whether one HTTP attempt counts against the target's breaker.

    Callers must use this (not their own rule) so every breaker trips on the same evidence:
    transport errors and timeouts, 5xx and 429 say the downstream is unhealthy or shedding
    load; any other 4xx is a business rejection of *this* request and never trips a breaker.
    A response without a status and without a transport error is not evidence either way.
    """
    if transport_error:
        return True
    if status_code is None:
        return False
    return status_code == 429 or status_code >= 500
