"""Rate and concurrency limits per target, obeyed by the whole fleet before a request leaves.

A circuit breaker reacts to failure; a limit prevents it. Limits are declared in the actions file
(``rate_limit``, ``max_in_flight``, per tenant ``rate_limit``), counted in Redis for the fleet
(shared.py), in memory without it (local.py), and asked in the call's thread (pacer.py).
"""

from workers.pacing.limits import Rate, TargetLimits, limits_of
from workers.pacing.pacer import SHORT_WAIT_S, Cleared, Deferred, Pacer

__all__ = ["SHORT_WAIT_S", "Cleared", "Deferred", "Pacer", "Rate", "TargetLimits", "limits_of"]
