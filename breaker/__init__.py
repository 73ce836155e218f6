"""Circuit breakers per target, state shared through Redis, operator reset.

A breaker wraps exactly one HTTP attempt; the retry loop is outside. Usage::

    registry = BreakerRegistry({"payments": BreakerConfig(fail_max=5, reset_timeout_s=30)},
                               redis_url=settings.redis_url, namespace="default")
    decision = registry.before_call("payments")   # Allowed(probe) | Open(reopens_at)
    ...                                           # one attempt, only if Allowed
    registry.record(decision, failure=counts_as_failure(status_code, transport_error))

Callers must decide "failure" with ``counts_as_failure``: transport errors, timeouts, 5xx and
429 count; business rejections (other 4xx) never trip a breaker.

Without a Redis URL each process has its own breakers (pybreaker memory storage). With one,
all processes in a namespace share each target's breaker, and exactly one caller in the fleet
probes while half-open.

When Redis is unreachable the registry falls back to process-local breakers and logs one
WARNING on entering and one on leaving that degraded mode (never per call); no exception
reaches the dispatch path. Local breakers still trip, and the ledger's retry budgets bound the
load on the downstream, so degrading costs at most fail_max attempts per process per reset
timeout. See breaker/README.md and breaker/registry.py.

A worker asks for a batch of calls at once through ``Admissions`` (breaker/admissions.py): a
closed breaker's admission shared by the batch, a probe held by one operation or given back.
"""

from __future__ import annotations

from breaker.admissions import Admissions
from breaker.config import BreakerConfig, counts_as_failure
from breaker.errors import BreakerError, BreakerStorageUnavailable, UnknownTarget
from breaker.operator import reset, status
from breaker.registry import BreakerRegistry
from breaker.state import Allowed, BreakerStatus, Decision, Open

__all__ = [
    "Admissions",
    "Allowed",
    "BreakerConfig",
    "BreakerError",
    "BreakerRegistry",
    "BreakerStatus",
    "BreakerStorageUnavailable",
    "Decision",
    "Open",
    "UnknownTarget",
    "counts_as_failure",
    "reset",
    "status",
]
