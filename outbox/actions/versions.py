"""An action's version: a digest of the part of its definition that shapes its request.

An operation records the version of its action at submit (``operations.action_version``) and the
version its first request that left was built under (``request_version``: outbox/ledger/request_record.py);
each dispatch attempt records the version its worker held at its claim (``attempts.action_version``).
A later attempt under the same key may build its request afresh only under the version of every
earlier attempt that may have left; otherwise it sends the request on record, or nothing
(workers/dispatch/same_request.py).

What counts (``action_version``): what decides where the request goes and what its method, path,
query and body are, given the arguments: the target's name and ``base_url``; the request's method,
path and query templates; ``decimal_args`` (money sent as decimal strings: ``500`` or ``"500"``);
the header that carries the provider's idempotency key (without it the provider cannot tell a retry
from a new request); and ``connector`` (a Python hook builds its own request). Not counted: header
values and credentials (rotating a token changes no request), the fencing header, timeouts, budgets,
lookups, approval rules, the ``provider_key`` template (the key is rendered once, at submit).

Key order, YAML spelling, a method's case, a trailing ``/`` of ``base_url`` and the order of
``decimal_args`` change nothing. Producers (which read only part of the file: outbox/actions/rules.py)
and workers (the whole file: workers/provider/actions.py) compute it with this one function.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from outbox.actions.files import resolve_env
from outbox.actions.specs import ProviderIdempotency, RequestSpec

# Hex characters kept of the SHA-256: 64 bits tell one action's definitions apart, and a person reads
# two of them in one sentence ("submitted under 3f1c..., current 9ab0...").
VERSION_CHARS = 16
# Raised when what counts changes, so that no two schemes can give one version to different requests.
SCHEME = 1


def action_version(
    *,
    target: str,
    base_url: str,
    request: RequestSpec,
    decimal_args: Iterable[str] = (),
    idempotency_header: str | None = None,
    connector: str | None = None,
) -> str:
    """The version of one action's request-shaping definition (the module docstring says what counts)."""
    shape = {
        "scheme": SCHEME,
        "target": target,
        "base_url": base_url.rstrip("/"),
        "method": request.method.upper(),
        "path": request.path,
        "query": dict(request.query),
        "decimal_args": sorted(set(decimal_args)),
        # HTTP header names are case-insensitive: Idempotency-Key and idempotency-key are one header.
        "idempotency_header": idempotency_header.lower() if idempotency_header else None,
        "connector": connector,
    }
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:VERSION_CHARS]


# The parts of an action (and of its target) the version reads: what a producer reads for it.
ACTION_PARTS = ("target", "request", "decimal_args", "provider_idempotency", "connector")


def version_of_raw(raw: Mapping[str, Any], targets: Any, environ: Mapping[str, str]) -> str | None:
    """``action_version`` of an action as written in the file (``raw``: its mapping; ``targets``:
    the file's ``targets``), for a producer. None when it cannot be told here: a part invalid (the
    workers' loader names it), or a ``${VAR}`` not set in the producer's environment (a worker-only
    variable): the operation then records no version at submit and its first request records it."""
    part = {k: raw[k] for k in ACTION_PARTS if k in raw}
    target_name = part.get("target")
    if not isinstance(targets, dict) or not isinstance(target_name, str):
        return None
    target = targets.get(target_name)
    if not isinstance(target, dict) or not isinstance(target.get("base_url"), str):
        return None
    unset: list[tuple[str, str]] = []
    part = resolve_env(part, environ, "", [], unset)
    base_url = resolve_env(target["base_url"], environ, "base_url", [], unset)
    if unset:
        return None
    decimal_args = part.get("decimal_args", [])
    connector = part.get("connector")
    keys = part.get("provider_idempotency")
    if not isinstance(decimal_args, list) or not all(isinstance(a, str) for a in decimal_args):
        return None
    if connector is not None and not isinstance(connector, str):
        return None
    try:
        request = RequestSpec.model_validate(part.get("request"))
        header = ProviderIdempotency.model_validate(keys).header if keys is not None else None
    except ValidationError:
        return None
    return action_version(
        target=target_name,
        base_url=base_url,
        request=request,
        decimal_args=decimal_args,
        idempotency_header=header,
        connector=connector,
    )
