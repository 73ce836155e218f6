"""Targets of the actions file: the downstream systems, their timeouts, credentials, breakers and limits.

The unit of circuit breaking, of connection pools and of rate and concurrency limits (DESIGN.md,
"Vocabulary"); actions name one.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from outbox.actions.specs import BreakerSpec, RateLimitSpec, _Strict
from outbox.actions.webhooks import WebhookEndpointSpec, secret_problem, secrets_of
from workers.provider.classify import DEFAULT_AUTHORITY_STATUSES


class TenantCredentials(_Strict):
    """One tenant at a target: its own provider account (``headers``) and its own share of the
    target's rate (``rate_limit``, applied in addition to the target's)."""

    # Header overrides for one tenant's own provider account (values from ${VAR}); repr=False as
    # for the target's headers. Only an entry that declares ``headers`` is an account: an entry
    # that declares just a limit lends none and turns no per-tenant credentials on.
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    rate_limit: RateLimitSpec | None = None
    # This tenant's own webhook endpoint secret (the target's ``webhooks.scheme``): it verifies events
    # at /v1/webhooks/<target>/<tenant> only, and they settle this tenant's operations only. A tenant
    # with an account of its own (``headers``) and none has no webhook endpoint: the target's secret
    # is another account's and never verifies its events.
    webhook_secret: str | list[str] | None = Field(default=None, repr=False)

    @property
    def is_account(self) -> bool:
        return "headers" in self.model_fields_set


class TargetConfig(_Strict):
    base_url: str
    timeout_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # repr=False: resolved headers usually carry secrets and must not reach logs via repr().
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    # Per-tenant credentials: when some tenant declares its headers, every request carries its
    # tenant's headers over ``headers``, and an operation of a tenant not listed fails before
    # sending (never with another tenant's credentials). Per-tenant limits live here too.
    tenants: dict[str, TenantCredentials] = Field(default_factory=dict, repr=False)
    breaker: BreakerSpec = Field(default_factory=BreakerSpec)
    # Pool size per target; one pooled client per target is shared by a worker's threads.
    max_connections: int = Field(default=20, gt=0)
    # Limits the whole fleet obeys before a request leaves (workers/pacing/): requests per second,
    # and requests in flight at once. None: no limit (and no Redis round trip on the call path).
    rate_limit: RateLimitSpec | None = None
    max_in_flight: int | None = Field(default=None, ge=1)
    # Send the attempt's (or lookup's) span downstream as a W3C ``traceparent`` header, so a provider
    # that traces continues the intent's trace. Off by default: a trace id is an identifier the
    # provider did not ask for. Only while tracing is on (workers/ground/tracing.py).
    propagate_trace: bool = False
    # Statuses by which this provider says it refused our authority (credentials revoked or expired,
    # a permission missing): nothing was executed, and a person must look (workers/provider/classify.py).
    # [] when none does; leave 403 out where it means something else (a temporary block, a rate limit).
    authority_statuses: list[int] = Field(default_factory=lambda: list(DEFAULT_AUTHORITY_STATUSES))
    # This base_url is the provider's test mode (a sandbox account): `agent-outbox probe` may send
    # real requests to it. Nothing else reads it.
    test_mode: bool = False
    # How the provider signs its webhooks (outbox/actions/webhooks.py); None: none are received.
    webhooks: WebhookEndpointSpec | None = None

    @field_validator("authority_statuses")
    @classmethod
    def _client_errors(cls, value: list[int]) -> list[int]:
        wrong = [code for code in value if not 400 <= code <= 499]
        if wrong:
            raise ValueError(
                f"{wrong} are not 4xx statuses: only a client error proves the provider refused the request "
                "without executing it (e.g. [401, 403]; [] for none)"
            )
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _webhook_secrets(self) -> TargetConfig:
        for name, tenant in self.tenants.items():
            for secret in secrets_of(tenant.webhook_secret):
                if self.webhooks is None:
                    raise ValueError(f"tenants.{name}.webhook_secret needs webhooks.scheme (how the provider signs)")
                problem = secret_problem(self.webhooks.scheme, secret)
                if problem:
                    raise ValueError(f"tenants.{name}.webhook_secret {problem}")
        if self.webhooks is not None and not secrets_of(self.webhooks.secret) and not self.webhook_tenants:
            raise ValueError("webhooks: declare a secret, or a webhook_secret for some tenant under tenants")
        return self

    @property
    def webhook_tenants(self) -> list[str]:
        """The tenants with a webhook endpoint secret of their own."""
        return sorted(n for n, t in self.tenants.items() if secrets_of(t.webhook_secret))

    @property
    def walled_tenants(self) -> list[str]:
        """The tenants whose events the target's own endpoint never verifies nor settles: those with a
        provider account of their own (their account signs their events, never the platform's secret)
        and those with a webhook secret of their own (they receive at their own endpoint)."""
        return sorted(n for n, t in self.tenants.items() if t.is_account or secrets_of(t.webhook_secret))

    def webhook_secret_owner(self, tenant: str | None) -> str | None:
        """Whose secrets verify an event at this target's endpoint for ``tenant`` (None: the target's own
        endpoint): ``""`` the target's, a tenant's name its own; None: there is no such endpoint.

        A tenant's endpoint exists only for a tenant listed under ``tenants``: its own ``webhook_secret``;
        without one, the target's, and only if it has no provider account of its own (it shares the
        platform's account, whose endpoint secret signs its events). A tenant with an account of its own
        never falls back to the target's secret; a tenant not listed has no endpoint."""
        if self.webhooks is None:
            return None
        if tenant is None:
            return "" if secrets_of(self.webhooks.secret) else None
        entry = self.tenants.get(tenant)
        if entry is None:
            return None
        if secrets_of(entry.webhook_secret):
            return tenant
        if entry.is_account or not secrets_of(self.webhooks.secret):
            return None
        return ""

    def webhook_secrets(self, tenant: str | None) -> list[str]:
        """The secrets that verify an event at this target's endpoint for ``tenant`` (None: the target's
        own endpoint; webhook_secret_owner says whose). Empty: there is no such endpoint."""
        owner = self.webhook_secret_owner(tenant)
        if owner is None or self.webhooks is None:
            return []
        return secrets_of(self.tenants[owner].webhook_secret) if owner else secrets_of(self.webhooks.secret)

    @property
    def accounts(self) -> dict[str, TenantCredentials]:
        """The tenants with a provider account of their own (an entry that declares ``headers``)."""
        return {name: t for name, t in self.tenants.items() if t.is_account}

    def headers_for(self, tenant: str) -> dict[str, str] | None:
        """The headers a request of ``tenant`` carries; None if this target has per-tenant
        credentials and none for ``tenant``."""
        accounts = self.accounts
        if not accounts:
            return dict(self.headers)
        own = accounts.get(tenant)
        return None if own is None else {**self.headers, **own.headers}
