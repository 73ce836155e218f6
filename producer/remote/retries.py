"""When the client sends a request again, and how long it waits first.

A request is sent again only when that cannot do anything twice:

- it provably did not reach the server (a refused or timed-out connect): always;
- the server said it did not process it (429, 503): always, waiting at least its ``Retry-After``;
- its answer was lost (a read timeout, a dropped connection) or a gateway answered 502/504: only if
  it is replay-safe (calls.py): a read, or a submit, which carries the SAME idempotency key and so
  can never store two intents;
- never after any other 4xx, nor after a 500 (the server's answer will not change).

Waits are tenacity's full-jitter exponential backoff (DESIGN.md, "Retry budget"), never shorter
than a Retry-After (capped at ``max_retry_after_s``), for at most ``attempts`` tries in all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import tenacity

from producer.remote.problems import NotConfigured, OutboxProblem, OutboxUnreachable, RateLimited, Unavailable

log = logging.getLogger("producer.remote")

# The server holds a long-poll up to 60 s; a connect that takes longer than this is a dead server.
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts``: tries in all (1: never again). ``base_delay_s``/``max_delay_s``: the backoff's
    first window and its cap. ``max_retry_after_s``: the longest Retry-After obeyed; a server asking
    for more is answered with the error (its caller decides whether to wait that long)."""

    attempts: int = 5
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    max_retry_after_s: float = 60.0

    def may_retry(self, exc: BaseException, replay_safe: bool) -> bool:
        if isinstance(exc, OutboxUnreachable):
            return replay_safe or not exc.reached_server
        if isinstance(exc, NotConfigured):
            return False
        if isinstance(exc, (RateLimited, Unavailable)) and exc.status in (429, 503):
            wait_s = exc.retry_after_s
            return wait_s is None or wait_s <= self.max_retry_after_s
        if isinstance(exc, Unavailable):  # a gateway's 502/504: the server may have acted
            return replay_safe
        return False

    def wait_s(self, state: tenacity.RetryCallState) -> float:
        backoff = tenacity.wait_random_exponential(multiplier=self.base_delay_s, max=self.max_delay_s)(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        said = exc.retry_after_s if isinstance(exc, OutboxProblem) else None
        return max(backoff, said or 0.0)

    def tenacity_kwargs(self, replay_safe: bool) -> dict[str, Any]:
        """What tenacity's Retrying / AsyncRetrying take for one call."""
        return {
            "stop": tenacity.stop_after_attempt(max(1, self.attempts)),
            "wait": self.wait_s,
            "retry": tenacity.retry_if_exception(lambda exc: self.may_retry(exc, replay_safe)),
            "before_sleep": _say_retry,
            "reraise": True,
        }


def _say_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.info("retrying in %.2f s (try %d failed: %s)", delay, state.attempt_number, exc)


def retry_after_s(response: httpx.Response, now: datetime | None = None) -> float | None:
    """The answer's Retry-After in seconds (delay-seconds or an HTTP-date), or None."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(int(value[:12]))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def unreachable(call_method: str, url: str, exc: httpx.TransportError, key: str | None) -> OutboxUnreachable:
    # A connect that failed or never got a pooled connection: nothing was sent. Anything later
    # (a write, a read, a dropped connection) may have reached the server.
    not_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
    return OutboxUnreachable(call_method, url, reached_server=not not_sent, idempotency_key=key)
