"""Targets of the actions file: the downstream systems, their timeouts, credentials and breakers.

The unit of circuit breaking and of connection pools (DESIGN.md, "Vocabulary"); actions name one.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from outbox.actions.specs import BreakerSpec, _Strict


class TenantCredentials(_Strict):
    # Header overrides for one tenant's own provider account (values from ${VAR}); repr=False as
    # for the target's headers.
    headers: dict[str, str] = Field(default_factory=dict, repr=False)


class TargetConfig(_Strict):
    base_url: str
    timeout_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # repr=False: resolved headers usually carry secrets and must not reach logs via repr().
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    # Per-tenant credentials: when given, every request carries its tenant's headers over
    # ``headers``, and an operation of a tenant not listed fails before sending (never with
    # another tenant's credentials).
    tenants: dict[str, TenantCredentials] = Field(default_factory=dict, repr=False)
    breaker: BreakerSpec = Field(default_factory=BreakerSpec)
    # Pool size per target; one pooled client per target is shared by a worker's threads.
    max_connections: int = Field(default=20, gt=0)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    def headers_for(self, tenant: str) -> dict[str, str] | None:
        """The headers a request of ``tenant`` carries; None if this target has per-tenant
        credentials and none for ``tenant``."""
        if not self.tenants:
            return dict(self.headers)
        own = self.tenants.get(tenant)
        return None if own is None else {**self.headers, **own.headers}
