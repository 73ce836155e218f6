"""Errors of the breaker package: one root, few leaves."""

from __future__ import annotations


class BreakerError(Exception):
    """Base class for breaker errors."""


class UnknownTarget(BreakerError):
    """No breaker is configured for this target."""

    def __init__(self, target: str) -> None:
        super().__init__(f"no breaker configured for target {target!r}")
        self.target = target


class BreakerStorageUnavailable(BreakerError):
    """Redis could not be reached, so the shared breaker state could not be read or written.

    Raised only to operators (status/reset through a Redis URL, reset of a shared breaker);
    the dispatch path never sees it and falls back to a process-local breaker instead.
    """

    def __init__(self, redis_url: str | None, reason: str) -> None:
        super().__init__(f"breaker storage unreachable: {reason}")
        self.redis_url, self.reason = redis_url, reason
