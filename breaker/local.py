"""Process-local breaker state: the embedded default, and the fallback when Redis is down.

Built on pybreaker's ``CircuitMemoryStorage`` so pybreaker's own introspection (state,
counter, success_counter, opened_at) keeps working, plus the same atomic operations as the
Redis store. Each operation holds a short lock around a few field updates, never around the
HTTP attempt, so threads never queue behind a slow downstream (pybreaker's ``call()`` holds
its lock for the whole call).
"""

from __future__ import annotations

import threading
import uuid

from pybreaker import STATE_CLOSED, STATE_HALF_OPEN, STATE_OPEN, CircuitMemoryStorage

from breaker.config import BreakerConfig
from breaker.state import Admission, Recorded, Snapshot, StateName, from_ms


class LocalBreakerStorage(CircuitMemoryStorage):
    """One target's breaker in this process's memory."""

    kind = "local"

    def __init__(self) -> None:
        super().__init__(STATE_CLOSED)
        self._lock = threading.Lock()
        self._opened_at_ms: int | None = None
        self._reopens_at_ms: int | None = None
        self._probe_token: str | None = None
        self._probe_expires_ms = 0

    def admit(self, config: BreakerConfig, now_ms: int) -> Admission:
        with self._lock:
            transition: StateName | None = None
            if self._state == STATE_CLOSED:
                return Admission(True, None, None, None, self._fail_counter, now_ms)
            if self._state == STATE_OPEN:
                assert self._reopens_at_ms is not None
                if now_ms < self._reopens_at_ms:
                    return Admission(False, None, self._reopens_at_ms, None, self._fail_counter, now_ms)
                self._state, self._success_counter = STATE_HALF_OPEN, 0
                transition = "half-open"
            # half-open: one probe at a time; an expired probe lock is as good as free.
            if self._probe_token is None or now_ms >= self._probe_expires_ms:
                self._probe_token = uuid.uuid4().hex
                self._probe_expires_ms = now_ms + int(config.probe_timeout_s * 1000)
                return Admission(True, self._probe_token, None, transition, self._fail_counter, now_ms)
            wait_ms = min(int(config.probe_wait_s * 1000), self._probe_expires_ms - now_ms)
            return Admission(False, None, now_ms + wait_ms, transition, self._fail_counter, now_ms)

    def settle(self, config: BreakerConfig, probe_token: str | None, failure: bool, now_ms: int) -> Recorded:
        with self._lock:
            if probe_token is None:
                # A result of an attempt admitted while closed. If the breaker has opened
                # meanwhile, the decision is made; late results neither count nor close.
                if self._state != STATE_CLOSED:
                    return self._settled(None)
                if not failure:
                    self._fail_counter = 0
                    return self._settled(None)
                self._fail_counter += 1
                if self._fail_counter >= config.fail_max:
                    self._open(config, now_ms)
                    return self._settled("open")
                return self._settled(None)
            holder_alive = self._probe_token is not None and now_ms < self._probe_expires_ms
            if self._state != STATE_HALF_OPEN or (holder_alive and self._probe_token != probe_token):
                # Stale probe: an operator reset, or our lock expired and someone else probes.
                return self._settled(None)
            self._probe_token = None
            if failure:
                self._open(config, now_ms)
                return self._settled("open")
            self._success_counter += 1
            if self._success_counter >= config.success_threshold:
                self._close()
                return self._settled("closed")
            return self._settled(None)

    def release(self, probe_token: str) -> bool:
        """Give back a probe that sent nothing; the state stays half-open for the next caller."""
        with self._lock:
            if self._probe_token != probe_token:
                return False
            self._probe_token = None
            return True

    def reset(self, by: str, now_ms: int) -> StateName:
        with self._lock:
            previous: StateName = self._state  # type: ignore[assignment]
            self._close()
            return previous

    def snapshot(self, now_ms: int) -> Snapshot:
        with self._lock:
            return Snapshot(
                state=self._state,  # type: ignore[arg-type]
                failures=self._fail_counter,
                successes=self._success_counter,
                opened_at_ms=self._opened_at_ms,
                reopens_at_ms=self._reopens_at_ms,
                probing=self._probe_token is not None and now_ms < self._probe_expires_ms,
            )

    def _open(self, config: BreakerConfig, now_ms: int) -> None:
        self._state, self._success_counter = STATE_OPEN, 0
        self._opened_at_ms = now_ms
        self._opened_at = from_ms(now_ms)
        # A fresh reset timeout on every opening, including a failed probe.
        self._reopens_at_ms = now_ms + int(config.reset_timeout_s * 1000)
        self._probe_token = None

    def _close(self) -> None:
        self._state = STATE_CLOSED
        self._fail_counter = self._success_counter = 0
        self._opened_at_ms = self._reopens_at_ms = None
        self._probe_token = None

    def _settled(self, transition: StateName | None) -> Recorded:
        state: StateName = self._state  # type: ignore[assignment]
        return Recorded(state, transition, self._fail_counter, self._success_counter)
