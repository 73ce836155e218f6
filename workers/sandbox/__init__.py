"""The sandbox provider: a real HTTP business API (refunds, tickets, emails) for tests and demos.

It behaves like a careful provider (Stripe-like idempotency keys, lookups, listings, fencing)
and, on request, like a careless one (no idempotency, lost responses, outages). It imports
nothing from the outbox, workers, producer or breaker packages: it plays the downstream.
"""

from __future__ import annotations


class ServerNotInstalled(ModuleNotFoundError):
    """The sandbox's HTTP server (aiohttp) is not installed: the core install leaves it out."""

    def __init__(self, missing: str | None) -> None:
        super().__init__(
            f"the sandbox needs its extra: pip install 'agent-outbox-ledger[sandbox]' (No module named {missing!r})",
            name=missing,
        )
