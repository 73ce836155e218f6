"""Fairness: how a dispatch claim shares what is due among tenants.

With fairness on (``OUTBOX_FAIRNESS=tenant``, the default) a claim serves the tenants with work due
in turn, each by its weight (``OUTBOX_TENANT_WEIGHTS``; 1 unless named), and inside a tenant its
higher priorities first, then its oldest. One tenant's backlog of thousands therefore takes at
most its share of each claim, and another tenant's new intent waits for the claims already in
flight plus one claim round, not behind the backlog. ``off``: the claim takes the highest priority,
then the oldest, whoever it belongs to.

A process remembers the last tenant it served (its cursor) and starts its next claim after it,
wrapping around: with more tenants due than one claim serves, consecutive claims serve the next
ones. The cursor is this process's only (several processes start at different places, which is
fine: each is fair on its own, and together they serve everyone).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from enum import StrEnum

# A weight above this is a typo rather than a share (one tenant 1000 times another's).
MAX_WEIGHT = 1000.0
WEIGHTS_FORMAT = "tenant=weight pairs separated by commas, e.g. 'acme=3,globex=1' (weights > 0 and <= 1000)"


class FairnessMode(StrEnum):
    TENANT = "tenant"  # tenants in turn, by weight; priority then age inside a tenant
    OFF = "off"  # priority then age, whoever the tenant


def parse_weights(text: str) -> dict[str, float]:
    """``acme=3,globex=1`` as {tenant: weight}; ValueError saying the expected form otherwise."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        tenant, sep, value = part.partition("=")
        tenant = tenant.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not tenant or not 0 < weight <= MAX_WEIGHT:
            raise ValueError(f"{part.strip()!r} is not tenant=weight; use {WEIGHTS_FORMAT}")
        if tenant in weights:
            raise ValueError(f"tenant {tenant!r} is weighted twice; use {WEIGHTS_FORMAT}")
        weights[tenant] = weight
    return weights


class Fairness:
    """One process's claim terms (mode, weights) and its cursor: the last tenant it served."""

    def __init__(self, mode: FairnessMode | str = FairnessMode.TENANT, weights: Mapping[str, float] | None = None):
        self.mode = FairnessMode(mode)
        self.weights = dict(weights or {})
        self._after = ""  # '' sorts before every tenant: the first claim starts at the first
        self._lock = threading.Lock()  # a process's doorbell threads claim concurrently

    @property
    def on(self) -> bool:
        return self.mode is FairnessMode.TENANT

    def claim_params(self) -> dict[str, object]:
        """The fair claim's parameters: the cursor and the weights as two arrays."""
        with self._lock:
            after = self._after
        return {"after_tenant": after, "weight_tenants": list(self.weights), "weights": list(self.weights.values())}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    @property
    def after(self) -> str:
        with self._lock:
            return self._after

    def served(self, tenant: str | None) -> None:
        """The last tenant a claim served (its last row in rank order): the next claim starts after it."""
        if tenant is not None:
            with self._lock:
                self._after = tenant
