"""Fairness: how a dispatch claim shares what is due among tenants.

With fairness on (``OUTBOX_FAIRNESS=tenant``, the default) a claim serves the tenants with work due
in turn, each by its weight (``OUTBOX_TENANT_WEIGHTS``; 1 unless named), and inside a tenant its
higher priorities first, then its oldest. One tenant's backlog of thousands therefore takes at
most its share of each claim, and another tenant's new intent waits for the claims already in
flight plus one claim round, not behind the backlog. ``off``: the claim takes the highest priority,
then the oldest, whoever it belongs to (on PostgreSQL among the tenants one claim walks: up to 32
after the cursor).

A process remembers the last tenant it served (its cursor) and starts its next claim after it,
wrapping around: with more tenants due than one claim serves, consecutive claims serve the next
ones. The cursor is this process's only (several processes start at different places, which is
fine: each is fair on its own, and together they serve everyone).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from outbox.settings import FairnessMode, parse_weights

__all__ = ["Fairness", "FairnessMode", "parse_weights"]


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

    def advance(self, after: str, tenants: Iterable[str]) -> None:
        """A claim that started after ``after`` served ``tenants``: the next one starts after the tenant
        served farthest round from there (not the last row's: with more rows than tenants walked, the
        last turns wrap back to the first tenants)."""
        served = list(tenants)
        if served:
            self.served(max(served, key=lambda tenant: (tenant <= after, tenant)))

    def served(self, tenant: str | None) -> None:
        """The last tenant a claim served (its last row in rank order): the next claim starts after it."""
        if tenant is not None:
            with self._lock:
                self._after = tenant
