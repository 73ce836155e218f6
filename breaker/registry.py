"""One breaker per target, guarding exactly one HTTP attempt, without serialising threads.

    decision = registry.before_call("payments")
    if isinstance(decision, Open):
        ... not sent: reschedule to decision.reopens_at, no attempt budget spent ...
    else:
        ... one HTTP attempt ...
        registry.record(decision, failure=counts_as_failure(status, transport_error))

The retry loop sits outside; the breaker sees one attempt at a time. Neither call holds a
lock across the attempt (pybreaker's ``call()`` and decorator do, which would queue every
thread of a worker behind one slow downstream), and neither raises when Redis is down.

Redis unreachable: the registry switches to process-local breakers (pybreaker memory storage)
and logs ONE WARNING when it enters that degraded mode and ONE WARNING when it leaves it, not
one per call. While degraded it re-tries Redis at most once per ``redis_retry_s``. Why not
fail closed (refuse all calls) or fall back to "closed" like pybreaker: refusing would stop all
dispatch because of a cache outage; "closed" would hammer a failing downstream with nothing to
stop it. Local breakers still trip after fail_max failures in each process, and the retry
budgets in the ledger bound the total load, so the cost of degradation is at most
fail_max x processes attempts per reset timeout instead of fail_max in total.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import redis
from pybreaker import (
    CircuitBreaker,
    CircuitBreakerListener,
    CircuitBreakerState,
    CircuitClosedState,
    CircuitHalfOpenState,
    CircuitOpenState,
)
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from breaker.config import BreakerConfig
from breaker.errors import BreakerStorageUnavailable, UnknownTarget
from breaker.local import LocalBreakerStorage
from breaker.state import Allowed, BreakerStatus, Decision, Open, StateName, from_ms
from breaker.storage import RedisBreakerStorage

log = logging.getLogger(__name__)

# Redis errors surface as RedisError; OSError covers a socket error that slips through.
_STORAGE_ERRORS = (RedisError, OSError)


def connect(redis_url: str) -> redis.Redis:
    """A client tuned for a check that must cost far less than the attempt it guards.

    Redis answers in well under a millisecond on the same network, so 250 ms to connect and
    500 ms per command already mean "down"; one immediate retry re-dials a pooled socket that
    died in a Redis restart, more retries would only delay the fallback.
    """
    return redis.Redis.from_url(
        redis_url,
        socket_connect_timeout=0.25,
        socket_timeout=0.5,
        retry=Retry(NoBackoff(), 1),
    )


class BreakerRegistry:
    """The breakers of one process, by target, sharing state through Redis when a URL is set."""

    def __init__(
        self,
        configs: Mapping[str, BreakerConfig],
        redis_url: str | None = None,
        namespace: str = "default",
        *,
        clock: Callable[[], float] | None = None,
        listeners: Sequence[CircuitBreakerListener] = (),
        redis_retry_s: float = 5.0,
    ) -> None:
        """clock: epoch seconds; None means Redis server time for shared state and
        time.time() for local state. redis_retry_s: while degraded, how often one call
        tries Redis again (every call would pay a connect timeout)."""
        self.configs = dict(configs)
        self.namespace = namespace
        self.redis_url = redis_url
        self._clock = clock
        self._mono = clock or time.monotonic
        self._redis_retry_s = redis_retry_s
        self._local = {t: LocalBreakerStorage() for t in self.configs}
        # One pybreaker CircuitBreaker per target: it carries name, thresholds and listeners
        # and reads the process-local storage. We never call through it (see module doc).
        self.breakers = {
            t: CircuitBreaker(
                fail_max=c.fail_max,
                reset_timeout=c.reset_timeout_s,
                success_threshold=c.success_threshold,
                state_storage=self._local[t],
                listeners=list(listeners),
                name=t,
            )
            for t, c in self.configs.items()
        }
        self._client = connect(redis_url) if redis_url else None
        self._shared = (
            {t: RedisBreakerStorage(self._client, namespace, t) for t in self.configs}
            if self._client is not None
            else {}
        )
        self._mode_lock = threading.Lock()
        self._degraded = False
        self._next_redis_try = 0.0

    # -- dispatch path ---------------------------------------------------------------------

    def before_call(self, target: str) -> Decision:
        """Allowed(probe) to send one attempt now, or Open(reopens_at) to reschedule."""
        config = self._config(target)
        if self._use_shared():
            try:
                admission = self._shared[target].admit(config, self._shared_now_ms())
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)
            else:
                self._leave_degraded()
                self._log_transition(target, admission.transition, admission.failures, "redis")
                if admission.allowed:
                    return Allowed(target, admission.probe_token is not None, "redis", admission.probe_token)
                return Open(target, from_ms(admission.reopens_at_ms), "redis", admission.wait_s())  # type: ignore[arg-type]
        admission = self._local[target].admit(config, self._local_now_ms())
        self._log_transition(target, admission.transition, admission.failures, "local")
        if admission.allowed:
            return Allowed(target, admission.probe_token is not None, "local", admission.probe_token)
        return Open(target, from_ms(admission.reopens_at_ms), "local", admission.wait_s())  # type: ignore[arg-type]

    def record(self, decision: Allowed, failure: bool) -> None:
        """Record the outcome of the one attempt ``decision`` admitted.

        failure must come from ``counts_as_failure``; a business rejection is a success for
        the breaker (the downstream answered). A probe's success closes the breaker (after
        success_threshold), its failure re-opens it with a fresh reset timeout.
        """
        config = self._config(decision.target)
        if decision.storage == "redis":
            try:
                settled = self._shared[decision.target].settle(
                    config, decision.probe_token, failure, self._shared_now_ms()
                )
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)
                # The attempt still happened: count it locally, as a plain (non-probe) result.
                decision = Allowed(decision.target, False, "local")
            else:
                self._log_transition(decision.target, settled.transition, settled.failures, "redis", decision.probe)
                return
        settled = self._local[decision.target].settle(config, decision.probe_token, failure, self._local_now_ms())
        self._log_transition(decision.target, settled.transition, settled.failures, "local", decision.probe)

    def release(self, decision: Decision) -> None:
        """The admitted attempt was not sent (nothing to claim, cancelled, budget spent).

        Nothing to do unless ``decision`` holds the half-open probe: then the probe is handed
        back so the next caller probes now, instead of every caller waiting for the probe lock
        to expire (probe_timeout_s) with no request in flight. The breaker state is unchanged.
        """
        if not isinstance(decision, Allowed) or decision.probe_token is None:
            return
        if decision.storage == "redis":
            try:
                self._shared[decision.target].release(decision.probe_token)
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)  # the lock expires on its own after probe_timeout_s
            return
        self._local[decision.target].release(decision.probe_token)

    # -- operators ---------------------------------------------------------------------------

    def status(self, targets: Sequence[str] | None = None) -> list[BreakerStatus]:
        rows = []
        for target in targets or list(self.configs):
            self._config(target)
            if self._shared and self._use_shared():
                try:
                    snap = self._shared[target].snapshot(self._shared_now_ms())
                except _STORAGE_ERRORS as exc:
                    self._enter_degraded(exc)
                else:
                    self._leave_degraded()
                    rows.append(
                        BreakerStatus(
                            target,
                            snap.state,
                            snap.failures,
                            from_ms(snap.opened_at_ms),
                            from_ms(snap.reopens_at_ms),
                            "redis",
                        )
                    )
                    continue
            snap = self._local[target].snapshot(self._local_now_ms())
            rows.append(
                BreakerStatus(
                    target,
                    snap.state,
                    snap.failures,
                    from_ms(snap.opened_at_ms),
                    from_ms(snap.reopens_at_ms),
                    "degraded" if self._shared else "local",
                )
            )
        return rows

    def reset(self, target: str, by: str) -> None:
        """Close the breaker now, in every process (it is stored in Redis).

        Raises BreakerStorageUnavailable if the shared state could not be written: the
        operator must know the reset did not reach the other processes.
        """
        self._config(target)
        previous = self._local[target].reset(by, self._local_now_ms())
        if self._shared:
            try:
                previous = self._shared[target].reset(by, self._shared_now_ms())
            except _STORAGE_ERRORS as exc:
                self._enter_degraded(exc)
                raise BreakerStorageUnavailable(self.redis_url, repr(exc)) from exc
        log.warning(
            "breaker reset by operator",
            extra={"target": target, "by": by, "previous_state": previous, "namespace": self.namespace},
        )
        self._notify(target, previous, "closed")

    @property
    def degraded(self) -> bool:
        return self._degraded

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- internals ---------------------------------------------------------------------------

    def _config(self, target: str) -> BreakerConfig:
        try:
            return self.configs[target]
        except KeyError:
            raise UnknownTarget(target) from None

    def _shared_now_ms(self) -> int | None:
        return None if self._clock is None else int(self._clock() * 1000)

    def _local_now_ms(self) -> int:
        return int((self._clock or time.time)() * 1000)

    def _use_shared(self) -> bool:
        if not self._shared:
            return False
        if not self._degraded:
            return True
        # Degraded: let one caller per redis_retry_s find out whether Redis is back.
        with self._mode_lock:
            now = self._mono()
            if now < self._next_redis_try:
                return False
            self._next_redis_try = now + self._redis_retry_s
            return True

    def _enter_degraded(self, exc: BaseException) -> None:
        with self._mode_lock:
            self._next_redis_try = self._mono() + self._redis_retry_s
            if self._degraded:
                return
            self._degraded = True
            # Local breakers start fresh: whatever they held is from an earlier outage.
            for local in self._local.values():
                local.reset("degraded", self._local_now_ms())
        log.warning(
            "breaker storage unreachable, using process-local breakers",
            extra={"namespace": self.namespace, "error": repr(exc)},
        )

    def _leave_degraded(self) -> None:
        if not self._degraded:
            return
        with self._mode_lock:
            if not self._degraded:
                return
            self._degraded = False
        log.warning(
            "breaker storage reachable again, using shared breakers",
            extra={"namespace": self.namespace},
        )

    def _log_transition(
        self,
        target: str,
        transition: StateName | None,
        failures: int,
        storage: Literal["redis", "local"],
        probe: bool = False,
    ) -> None:
        if transition is None:
            return
        extra = {
            "target": target,
            "failures": failures,
            "state": transition,
            "storage": storage,
            "namespace": self.namespace,
        }
        if transition == "open":
            log.warning("breaker opened", extra=extra)
            previous = "half-open" if probe else "closed"
        elif transition == "half-open":
            log.info("breaker half-open", extra=extra)
            previous = "open"
        else:
            log.info("breaker closed", extra=extra)
            previous = "half-open"
        self._notify(target, previous, transition)

    def _notify(self, target: str, previous: str, new: str) -> None:
        breaker = self.breakers[target]
        if not breaker.listeners:
            return

        # notify=False: these state objects are only labels for listeners; with True,
        # pybreaker would reset counters in the storage as a side effect.
        def label(name: str) -> CircuitBreakerState:
            if name == "open":
                return CircuitOpenState(breaker)
            if name == "half-open":
                return CircuitHalfOpenState(breaker, None)
            return CircuitClosedState(breaker)

        for listener in breaker.listeners:
            try:
                listener.state_change(breaker, label(previous), label(new))
            except Exception:  # a listener must never break dispatch
                log.exception("breaker listener failed", extra={"target": target})
