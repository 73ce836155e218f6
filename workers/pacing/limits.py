"""The limits a target declares (rate, concurrency, per-tenant rate), as the limiters read them.

Built once from the actions file; only targets that declare a limit are here, so a call to any
other target asks nothing of anyone (no Redis round trip).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from outbox.actions.specs import RateLimitSpec
from workers.provider.actions import ActionsFile
from workers.provider.targets import TargetConfig

LimitKind = Literal["rate", "concurrency"]

# A tenant holds at most its share of this long's turns ahead, shared by the tenants holding turns
# or waiting in line at the target (shared.py). Alone, a tenant's calls wait in their threads for up
# to this many seconds' turns: fewer trips through the ledger, and enough turns to cover the gaps
# while calls sent back return in clumps, one per relay tick (half a second gave a single tenant
# 33/s of a 50/s limit). A tenant arriving behind another's held turns finds its own next turn
# within a call's wait in its thread (pacer.py SHORT_WAIT_S, 1 s): it is not sent back for them.
SHARE_HORIZON_S = 0.8


def whole_us(seconds: float) -> int:
    """Seconds as whole microseconds, as both limiters count time (Redis's script takes integers)."""
    return max(0, round(seconds * 1_000_000))


@dataclass(frozen=True)
class Rate:
    """``per_s`` requests a second, up to ``burst`` at once (GCRA: emission interval 1/per_s, and a
    tolerance of burst - 1 intervals)."""

    per_s: float
    burst: int

    @property
    def interval_s(self) -> float:
        return 1.0 / self.per_s

    @property
    def tolerance_s(self) -> float:
        return self.interval_s * (self.burst - 1)

    def shared_by(self, processes: int) -> Rate:
        """One process's share when ``processes`` share the limit without a common counter: never
        more than the whole together (a burst below one process each still lets one through)."""
        n = max(1, processes)
        return Rate(self.per_s / n, max(1, self.burst // n))

    def __str__(self) -> str:
        return f"{self.per_s:g}/s"


@dataclass(frozen=True)
class RateScope:
    """One rate a call is held to: the target's (``tenant`` None) or one tenant's at the target."""

    target: str
    tenant: str | None
    rate: Rate
    share: int = 1  # this process's rate is 1/share of the declared one (no common counter)

    @property
    def key(self) -> str:
        """Its name under the target's keys (shared by the Redis and the process-local limiter)."""
        return "rate" if self.tenant is None else f"tenant:{self.tenant}:rate"

    def shared_by(self, processes: int) -> RateScope:
        return RateScope(self.target, self.tenant, self.rate.shared_by(processes), max(1, processes))

    def why(self) -> str:
        """The reason text people read: which limit, its declared value, and the share kept to."""
        declared = f"{self.rate.per_s * self.share:g}/s"
        whose = f"target {self.target}" if self.tenant is None else f"tenant {self.tenant} at target {self.target}"
        said = f"rate limit of {whose}: {declared}"
        return said if self.share == 1 else f"{said} (this process keeps to 1/{self.share} while Redis is away)"


@dataclass(frozen=True)
class TargetLimits:
    """What one target declares. ``call_s``: the longest one call may take (connect + read
    timeouts): a concurrency slot is leased for that plus a margin, so a worker killed while
    holding one leaks it only until then."""

    target: str
    rate: Rate | None
    max_in_flight: int | None
    tenant_rates: Mapping[str, Rate] = field(default_factory=dict)
    call_s: float = 0.0

    def scopes_for(self, tenant: str) -> list[RateScope]:
        scopes = []
        if self.rate is not None:
            scopes.append(RateScope(self.target, None, self.rate))
        own = self.tenant_rates.get(tenant)
        if own is not None:
            scopes.append(RateScope(self.target, tenant, own))
        return scopes

    def slots(self, processes: int = 1) -> int | None:
        """Concurrency slots: all of them, or one process's share (at least one)."""
        if self.max_in_flight is None:
            return None
        return max(1, self.max_in_flight // max(1, processes))

    def concurrency_why(self) -> str:
        return f"concurrency limit of target {self.target}: {self.max_in_flight} in flight"

    def describe(self) -> str:
        """The declared limits in one line (the console's breakers page)."""
        parts = []
        if self.rate is not None:
            parts.append(f"{self.rate} (burst {self.rate.burst})")
        if self.max_in_flight is not None:
            parts.append(f"{self.max_in_flight} in flight")
        parts += [f"tenant {name}: {rate} (burst {rate.burst})" for name, rate in sorted(self.tenant_rates.items())]
        return "; ".join(parts)


@dataclass(frozen=True)
class Ask:
    """One call asking to go: the rates it is held to, the concurrency slots of its target (None:
    no concurrency limit), the slot's holder id and lease, and how long it may wait in its thread.
    ``not_before_s``: no rate gives a turn sooner than this from now (a switch of limiter lets the
    turns the other one handed out pass first). ``tenant``: whose call it is; ``horizon_s``: a tenant
    holds at most its share of this long's turns ahead."""

    target: str
    scopes: list[RateScope]
    slots: int | None
    holder: str
    max_wait_s: float
    slot_lease_s: float
    not_before_s: float = 0.0
    tenant: str = ""  # whose call: a call sent back takes its place in its tenant's line
    horizon_s: float = SHARE_HORIZON_S


@dataclass(frozen=True)
class PaceDecision:
    """A limiter's answer to one call asking to go. ``go``: the call may leave after ``wait_s`` (its
    turn is reserved: it sleeps, then sends without asking again). Otherwise ``limit`` says what held it, and ``wait_s``
    how long until it could go (a rate) or until the earliest slot's lease ends (a bound: concurrency).
    ``scope``: the rate that set the wait, if one did. ``live``: processes seen sharing the limits
    (Redis only)."""

    go: bool
    wait_s: float
    limit: LimitKind | None = None
    scope: RateScope | None = None
    live: int | None = None


def _rate(spec: RateLimitSpec | None) -> Rate | None:
    return None if spec is None else Rate(spec.per_s, spec.burst_or_default)


def limits_of_target(name: str, target: TargetConfig) -> TargetLimits | None:
    tenant_rates = {t: r for t, cfg in target.tenants.items() if (r := _rate(cfg.rate_limit)) is not None}
    rate = _rate(target.rate_limit)
    if rate is None and target.max_in_flight is None and not tenant_rates:
        return None
    return TargetLimits(name, rate, target.max_in_flight, tenant_rates, target.timeout_s + target.connect_timeout_s)


def limits_of(actions: ActionsFile) -> dict[str, TargetLimits]:
    """The targets of the actions file that declare a limit (the others are absent)."""
    found = {name: limits_of_target(name, t) for name, t in actions.targets.items()}
    return {name: limits for name, limits in found.items() if limits is not None}
