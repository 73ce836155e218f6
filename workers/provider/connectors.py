"""Connectors: one attempt to a downstream, classified; lookups by key; Python-hook connectors.

``HttpConnector`` never raises for transport errors: every attempt ends as an AttemptResult whose
classification comes from the one failure table (classify.py). The idempotency key and the
fencing token travel with every attempt (when the action declares their headers).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from outbox.errors import ConfigError
from outbox.ledger import tracing
from outbox.ledger.states import AttemptClass
from workers.provider.actions import ActionConfig, ActionsFile, TargetConfig
from workers.provider.classify import (
    Classification,
    LocalValidationError,
    Progress,
    classify_exception,
    classify_response,
)
from workers.provider.http_request import PreparedRequest, SentRequest, prepare, relative_path, request_digest
from workers.provider.lookups import LookupResult, interpret_lookup

# Enough of a failed response to explain it in a handoff, small enough for an attempt row.
RAW_ERROR_EXCERPT_BYTES = 500

# No Accept-Encoding: answers are small JSON, and an uncompressed body is what the digest and the
# raw-error excerpt should see.
_DEFAULT_HEADERS = {"User-Agent": "agent-outbox", "Accept": "application/json"}


@dataclass(frozen=True)
class AttemptResult:
    classification: Classification
    request_digest: str  # "" when the request could not even be built
    status_code: int | None
    latency_s: float
    raw_error: str | None  # repr of the exception, or a short excerpt of a non-success body
    sent: SentRequest | None = None  # what was put on the wire (HttpConnector); None: nothing, or a hook's own


def _timeout(target: TargetConfig) -> httpx.Timeout:
    return httpx.Timeout(target.timeout_s, connect=target.connect_timeout_s)


class LookupNotDeclared(ConfigError):
    """The action has no lookup; an ambiguous attempt can only be settled by a person."""


class Connector(Protocol):
    def send(
        self,
        action_name: str,
        action_cfg: ActionConfig,
        *,
        args: dict[str, Any],
        idempotency_key: str,
        fencing_token: int,
        tenant: str = "",
    ) -> AttemptResult: ...

    def lookup(
        self,
        action_name: str,
        action_cfg: ActionConfig,
        *,
        args: dict[str, Any],
        idempotency_key: str,
        fencing_token: int | None = None,
        tenant: str = "",
    ) -> LookupResult: ...

    def close(self) -> None: ...


class HttpConnector:
    """HTTP to the targets of an actions file; one connection pool per target, thread-safe.

    Attempts and lookups go straight to the target's httpx transport (its pool) with a request
    built here, not through ``httpx.Client.send``: the client would keep a cookie jar shared by
    every tenant's operations (a provider's Set-Cookie would ride along on everyone's next
    request), and its cookie, auth and redirect machinery cost about as much CPU per call as the
    HTTP exchange itself. Redirects are answers we classify, never followed.
    """

    def __init__(
        self,
        config: ActionsFile,
        *,
        transport_factory: Callable[[TargetConfig], httpx.BaseTransport] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._transport_factory = transport_factory
        self._clock = clock
        self._transports: dict[str, httpx.BaseTransport] = {}
        self._clients: dict[str, httpx.Client] = {}
        self._lock = threading.Lock()

    def _transport_for(self, target_name: str) -> httpx.BaseTransport:
        with self._lock:
            transport = self._transports.get(target_name)
            if transport is None:
                target = self._config.targets[target_name]
                if self._transport_factory is not None:
                    transport = self._transport_factory(target)
                else:
                    transport = httpx.HTTPTransport(
                        limits=httpx.Limits(
                            max_connections=target.max_connections, max_keepalive_connections=target.max_connections
                        )
                    )
                self._transports[target_name] = transport
            return transport

    def client_for(self, target_name: str, tenant: str | None = None) -> httpx.Client:
        """An httpx client over the target's pool, for paged reads (the report's listings); with
        ``tenant``, carrying that tenant's credentials (targets.<name>.tenants)."""
        transport = self._transport_for(target_name)
        headers = self._credentials(target_name, tenant) if tenant is not None else None
        with self._lock:
            client = self._clients.get(f"{target_name}\0{tenant or ''}")
            if client is None:
                target = self._config.targets[target_name]
                client = httpx.Client(
                    base_url=target.base_url,
                    headers=headers if headers is not None else target.headers,
                    timeout=_timeout(target),
                    follow_redirects=False,
                    transport=transport,
                )
                self._clients[f"{target_name}\0{tenant or ''}"] = client
            return client

    def _credentials(self, target_name: str, tenant: str) -> dict[str, str]:
        """The target's headers for ``tenant``; raises (nothing is sent) if the target keeps
        per-tenant credentials and has none for it: never another tenant's."""
        headers = self._config.targets[target_name].headers_for(tenant)
        if headers is None:
            raise LocalValidationError(
                f"tenant {tenant!r} has no credentials for target {target_name!r}: "
                f"add targets.{target_name}.tenants.{tenant or '<tenant>'}.headers to the actions file",
                retryable=True,
            )
        return headers

    def _propagate(self, target_name: str, headers: dict[str, str]) -> None:
        """``propagate_trace: true`` on the target: the call carries the attempt's (or lookup's)
        span as W3C ``traceparent``, so the provider's own trace continues the intent's."""
        if self._config.targets[target_name].propagate_trace:
            current = tracing.current()
            if current:
                headers["traceparent"] = current

    def _request(
        self, target_name: str, prepared: PreparedRequest, headers: dict[str, str], credentials: dict[str, str]
    ) -> httpx.Request:
        target = self._config.targets[target_name]
        return httpx.Request(
            prepared.method,
            target.base_url + prepared.path,
            params=prepared.query or None,
            headers={**_DEFAULT_HEADERS, **credentials, **headers},
            content=prepared.body,
            extensions={"timeout": _timeout(target).as_dict()},
        )

    def _exchange(self, target_name: str, request: httpx.Request) -> httpx.Response:
        """One request on the target's pool; the whole body read, the connection handed back."""
        response = self._transport_for(target_name).handle_request(request)
        response.request = request
        try:
            response.read()
        finally:
            response.close()
        return response

    def send(
        self,
        action_name: str,
        action_cfg: ActionConfig,
        *,
        args: dict[str, Any],
        idempotency_key: str,
        fencing_token: int,
        tenant: str = "",
        recorded: PreparedRequest | None = None,
    ) -> AttemptResult:
        """One attempt: ``recorded`` (the request on record under the key: workers/dispatch/same_request.py)
        as it is, else the action's request built from ``args``."""
        started = self._clock()
        try:
            credentials = self._credentials(action_cfg.target, tenant)
            prepared = recorded or prepare(
                action_cfg.request, args, idempotency_key=idempotency_key, decimal_args=action_cfg.decimal_args
            )
        except LocalValidationError as exc:
            return AttemptResult(classify_exception(exc), "", None, 0.0, repr(exc))
        headers = dict(prepared.headers)
        if action_cfg.provider_idempotency is not None:
            # The same key on every attempt: the provider's dedup is what makes a replay safe.
            headers[action_cfg.provider_idempotency.header] = idempotency_key
        if action_cfg.fencing_header is not None:
            headers[action_cfg.fencing_header] = str(fencing_token)
        self._propagate(action_cfg.target, headers)
        request = self._request(action_cfg.target, prepared, headers, credentials)
        digest = request_digest(request.method, str(request.url), prepared.body)
        base_url = self._config.targets[action_cfg.target].base_url
        sent = SentRequest(request.method, relative_path(request.url.raw_path, base_url), prepared.body, digest)
        try:
            response = self._exchange(action_cfg.target, request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a classified attempt
            return AttemptResult(classify_exception(exc), digest, None, self._clock() - started, repr(exc), sent)
        latency_s = self._clock() - started
        spec = action_cfg.lookup
        classification = classify_response(
            response.status_code,
            response.headers,
            response.content,
            result_reference=action_cfg.result_reference,
            status_map=action_cfg.status_map,
            # The lookup's status lists read the send's own answer too: accepted is not completed.
            progress=Progress(spec.status_field, tuple(spec.pending), tuple(spec.failed)) if spec else None,
            authority_statuses=self._config.targets[action_cfg.target].authority_statuses,
        )
        raw_error = None
        if classification.klass is not AttemptClass.SUCCEEDED:
            raw_error = response.content[:RAW_ERROR_EXCERPT_BYTES].decode("utf-8", errors="replace")
        return AttemptResult(classification, digest, response.status_code, latency_s, raw_error, sent)

    def lookup(
        self,
        action_name: str,
        action_cfg: ActionConfig,
        *,
        args: dict[str, Any],
        idempotency_key: str,
        fencing_token: int | None = None,
        tenant: str = "",
    ) -> LookupResult:
        """Ask the provider for the key's effect, carrying the reconciler's fencing token.

        The token (in the action's ``fencing_header``) is newer than every dispatch attempt's: a
        provider that fences refuses every older token for the key from this moment, so a frozen
        worker's request cannot land after this lookup found nothing (``provider_fencing``).
        """
        spec = action_cfg.lookup
        if spec is None:
            raise LookupNotDeclared(f"action {action_name!r} declares no lookup")
        started = self._clock()
        try:
            credentials = self._credentials(action_cfg.target, tenant)
            prepared = prepare(spec.request, args, idempotency_key=idempotency_key, send_rest=False)
        except LocalValidationError as exc:
            return LookupResult("unavailable", f"local_validation: {exc}")
        headers = dict(prepared.headers)
        if action_cfg.fencing_header is not None and fencing_token is not None:
            headers[action_cfg.fencing_header] = str(fencing_token)
        self._propagate(action_cfg.target, headers)
        try:
            request = self._request(action_cfg.target, prepared, headers, credentials)
            response = self._exchange(action_cfg.target, request)
        except Exception as exc:  # noqa: BLE001 - a lookup that fails proves nothing
            return LookupResult("unavailable", classify_exception(exc).reason, latency_s=self._clock() - started)
        latency_s = self._clock() - started
        return interpret_lookup(
            response.status_code, response.content, spec, action_cfg.result_reference, idempotency_key, latency_s, args
        )

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            transports, self._transports = list(self._transports.values()), {}
        for client in clients:
            client.close()  # closes its transport too; closing a transport twice is harmless
        for transport in transports:
            transport.close()

    def __enter__(self) -> HttpConnector:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- Python-hook connectors -----------------------------------------------------------------

ConnectorFactory = Callable[[ActionsFile], Connector]
_registry: dict[str, ConnectorFactory] = {}
_registry_lock = threading.Lock()


def register_connector(name_or_action: str, factory: ConnectorFactory) -> None:
    """Register a connector factory under an action name, or a name actions refer to via
    ``connector: name``. Registering the same name twice replaces the factory."""
    with _registry_lock:
        _registry[name_or_action] = factory


def unregister_connector(name_or_action: str) -> None:
    with _registry_lock:
        _registry.pop(name_or_action, None)


def _accepts(method: Any, name: str) -> bool | None:
    """Whether ``method`` takes the keyword ``name`` (None: not introspectable)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return None
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class _WithoutTenant:
    """A hook written before per-tenant credentials: called without ``tenant=`` (its own
    credentials are its business; HttpConnector's per-tenant headers do not apply to it)."""

    def __init__(self, inner: Connector) -> None:
        self._inner = inner

    def send(self, *args: Any, tenant: str = "", **kw: Any) -> AttemptResult:
        return self._inner.send(*args, **kw)

    def lookup(self, *args: Any, tenant: str = "", **kw: Any) -> LookupResult:
        return self._inner.lookup(*args, **kw)

    def close(self) -> None:
        self._inner.close()


def _checked(action_name: str, connector: Connector) -> Connector:
    """A hook's lookup must take the fencing token (lookups carry it): say so at start-up. A hook
    that does not take ``tenant=`` is called without it."""
    if _accepts(connector.lookup, "fencing_token") is False:
        raise ConfigError(
            f"action {action_name!r}: connector {type(connector).__name__}.lookup() must accept "
            "fencing_token= (the reconciler's token; send it in the action's fencing_header)"
        )
    if _accepts(connector.send, "tenant") is False or _accepts(connector.lookup, "tenant") is False:
        return _WithoutTenant(connector)
    return connector


def resolve_factory(action_name: str, action_cfg: ActionConfig) -> ConnectorFactory | None:
    """The custom factory for an action, or None for the HTTP connector.

    Order: ``connector:`` (a registered name, else ``module:callable`` imported), then a
    factory registered under the action's own name.
    """
    ref = action_cfg.connector
    with _registry_lock:
        if ref is not None and ref in _registry:
            return _registry[ref]
        if ref is None:
            return _registry.get(action_name)
    if ":" not in ref:
        raise ConfigError(f"action {action_name!r}: connector {ref!r} is not registered")
    module_name, _, attr = ref.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"action {action_name!r}: cannot load connector {ref!r}: {exc}") from exc
    if not callable(factory):
        raise ConfigError(f"action {action_name!r}: connector {ref!r} is not callable")
    return factory  # type: ignore[no-any-return]


class ConnectorSet:
    """The connector for each action: custom hooks where declared, one shared HttpConnector otherwise."""

    def __init__(self, config: ActionsFile, http: HttpConnector | None = None) -> None:
        self._config = config
        self.http = http or HttpConnector(config)
        self._custom: dict[str, Connector] = {}
        # Resolve all hooks now, so a typo in `connector:` stops the worker at start-up.
        for name, action in config.actions.items():
            factory = resolve_factory(name, action)
            if factory is not None:
                self._custom[name] = _checked(name, factory(config))

    def for_action(self, action_name: str) -> Connector:
        self._config.action(action_name)  # raises UnknownAction listing the known ones
        return self._custom.get(action_name, self.http)

    def close(self) -> None:
        self.http.close()
        for connector in {id(c): c for c in self._custom.values()}.values():
            connector.close()
