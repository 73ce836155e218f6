"""The provider's business API: create, look up, list and retrieve refunds, tickets and emails.

Each request passes three fault phases (faults.py): before commit (nothing happens), processing
(the idempotency key is in flight) and after commit (the object exists; its response may be lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from workers.sandbox import admin
from workers.sandbox.delivery import Reply, deliver, error, fail_before_commit
from workers.sandbox.effects import Effect
from workers.sandbox.faults import BEFORE_COMMIT, FaultRule, RuleError, parse_rule
from workers.sandbox.idempotency import KeyInUse, KeyMismatch, StoredResponse, params_digest
from workers.sandbox.requestlog import BODY_KEPT
from workers.sandbox.resources import RESOURCES, Rejection, invalid, over_limit
from workers.sandbox.responses import encode, error_body
from workers.sandbox.state import SandboxState
from workers.sandbox.store import StoredObject
from workers.sandbox.webhooks import run_sender

log = logging.getLogger(__name__)

STATE = web.AppKey("state", SandboxState)
# The listing's own parameters; any other one filters by an object's field.
LIST_PARAMS = frozenset({"created_after", "limit", "starting_after"})
JSON = "application/json"
_rid_prefix = secrets.token_hex(4)
_rid_seq = itertools.count(1)


def new_request_id() -> str:
    # A counter is cheaper than a random id per request and still unique per process.
    return f"req_{_rid_prefix}{next(_rid_seq):010d}"


def tenant_of(request: web.Request) -> str:
    """The API key is the tenant scope (Stripe scopes keys per account); missing = default."""
    auth = request.headers.get("Authorization")
    if not auth:
        return "default"
    return auth[7:].strip() if auth[:7].lower() == "bearer " else auth.strip()


def select_fault(request: web.Request, state: SandboxState, key: str | None, tenant: str) -> FaultRule | None:
    """A per-request script (X-Sandbox-Fault header) wins over the rule book."""
    scripted = request.headers.get("X-Sandbox-Fault")
    if scripted is not None:
        try:
            body: Any = json.loads(scripted) if scripted.lstrip().startswith("{") else scripted
            return parse_rule(body)
        except (RuleError, ValueError) as exc:
            raise web.HTTPBadRequest(
                body=encode(error_body("invalid_request_error", "invalid_fault", str(exc), "X-Sandbox-Fault")),
                content_type=JSON,
            ) from exc
    rule = state.faults.select(request.method, request.path, key, tenant)
    if rule is not None:
        log.info(
            "fault injected",
            extra={
                "mode": rule.mode,
                "fault_id": rule.id,
                "path": request.path,
                "idempotency_key": key,
                "tenant": tenant,
            },
        )
    return rule


@dataclass
class Arrival:
    """A business request as it arrives: logged, its fault (if any) chosen, not yet acted on."""

    state: SandboxState
    spec: Any
    tenant: str
    entry: Any
    rid: str
    rule: FaultRule | None


async def arrive(request: web.Request, key: str | None, token_raw: str | None) -> Arrival | web.StreamResponse:
    """The prelude every business endpoint shares; a fault before commit answers right here."""
    state = request.app[STATE]
    spec = RESOURCES.get(request.match_info["resource"])
    if spec is None:
        raise web.HTTPNotFound()
    tenant = tenant_of(request)
    entry = state.requests.open(
        state.clock.now(), request.method, request.path, request.query_string, tenant, key, token_raw
    )
    entry.traceparent = request.headers.get("traceparent")
    rid = new_request_id()
    rule = select_fault(request, state, key, tenant)
    if rule is not None:
        entry.fault, entry.fault_id = rule.mode, rule.id
        if rule.mode in BEFORE_COMMIT:
            return await fail_before_commit(request, entry, rule, rid)
    return Arrival(state, spec, tenant, entry, rid, rule)


async def handle_create(request: web.Request) -> web.StreamResponse:
    key = request.headers.get("Idempotency-Key")
    token_raw = request.headers.get("X-Fencing-Token")
    a = await arrive(request, key, token_raw)
    if not isinstance(a, Arrival):
        return a
    raw = await request.read()  # aiohttp keeps it: create() reads it again
    a.entry.body, a.entry.body_digest = raw.decode("utf-8", "replace")[:BODY_KEPT], hashlib.sha256(raw).hexdigest()
    reply = await create(request, a.state, a.spec.name, a.tenant, key, token_raw, a.rule, a.rid)
    response = await deliver(request, a.entry, a.rule, reply)
    a.entry.answered = time.time()
    return response


async def create(
    request: web.Request,
    state: SandboxState,
    resource: str,
    tenant: str,
    key: str | None,
    token_raw: str | None,
    rule: FaultRule | None,
    rid: str,
) -> Reply:
    spec = RESOURCES[resource]
    config = state.config
    # Bind the stores now: a reset during a slow request must not leak its object into the next test.
    keys, objects, effects, clock = state.keys, state.objects, state.effects, state.clock
    token: int | None = None
    if token_raw is not None:
        try:
            token = int(token_raw)
        except ValueError:
            return error(
                400,
                rid,
                "invalid_request_error",
                "invalid_fencing_token",
                "X-Fencing-Token must be an integer.",
                "X-Fencing-Token",
            )
    if key is not None and not 1 <= len(key) <= 255:  # Stripe's documented key length limit
        return error(
            400,
            rid,
            "invalid_request_error",
            "invalid_idempotency_key",
            "Idempotency-Key must be 1 to 255 characters.",
            "Idempotency-Key",
        )
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return error(400, rid, "invalid_request_error", "invalid_json", "Body must be a JSON object.")
    mode = rule.mode if rule is not None else None
    fencing = config.strict_fencing and mode != "ignore_fencing"
    if fencing and key is not None and token is not None:
        refused = _stale_token(rid, token, state.fencing.admit(tenant, key, token))
        if refused is not None:
            return refused
    # The query is part of the parameters (Stripe compares them all): /v1/refunds?v=2 is another request.
    digest = params_digest(request.method, request.path_qs, body)
    use_keys = config.idempotency and key is not None and mode != "ignore_idempotency_key"
    now = clock.now()
    if use_keys:
        assert key is not None
        try:
            compares = config.compare_params and mode != "accept_changed_args"
            stored = keys.begin(tenant, key, digest, now, config.retention_s, check_digest=compares)
        except KeyMismatch:
            return error(
                config.params_mismatch_status,
                rid,
                "idempotency_error",
                "idempotency_error",
                "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                "Idempotency-Key",
            )
        except KeyInUse:
            return error(
                409,
                rid,
                "idempotency_error",
                "key_in_use",
                "A request with this idempotency key is still being processed; retry later.",
                "Idempotency-Key",
            )
        if stored is not None:
            return Reply(stored.status, stored.body, rid, replayed_from=stored.request_id)
    try:
        if rule is not None and rule.latency_ms:
            await asyncio.sleep(rule.latency_ms / 1000)  # processing time: the key is in flight
        if fencing and key is not None and token is not None:
            # Checked again at commit: a newer token may have arrived while this one was processed.
            refused = _stale_token(rid, token, state.fencing.stale(tenant, key, token))
            if refused is not None:
                return refused
        try:
            if rule is not None and rule.mode == "reject_422":
                raise invalid("invalid_amount", "amount", "amount is invalid (injected).")
            if rule is not None and rule.mode == "reject_402":
                raise over_limit(config.over_limit_amount)
            params = spec.validate(body, config.over_limit_amount)
        except Rejection as rejection:
            reply = Reply(rejection.status, encode(rejection.body), rid)
            # 422 = failed validation, not saved (Stripe); 402 = the endpoint ran and decided: saved.
            if use_keys and rejection.status == 402:
                assert key is not None
                keys.complete(tenant, key, StoredResponse(reply.status, reply.body, rid))
            return reply
        now = clock.now()
        seq = next(state.seq)
        processing = config.processing_s > 0
        fails = processing and bool(config.processing_fails) and fnmatch.fnmatchcase(key or "", config.processing_fails)
        obj = StoredObject(spec.new_id(), spec, tenant, key, params, now, now + config.processing_s, seq, fails)
        objects.add(obj)
        effects.record(Effect(seq, obj.id, resource, tenant, key, digest, token, now))
        state.webhooks.created(config, obj, now)  # a signed event, if webhook_url is set
        reply = Reply(config.processing_status if processing else 200, encode(obj.render(now)), rid, object_id=obj.id)
        if use_keys:
            assert key is not None
            keys.complete(tenant, key, StoredResponse(reply.status, reply.body, rid))
        return reply
    finally:
        if use_keys:
            assert key is not None
            keys.release(tenant, key)  # no-op once completed; frees the key if nothing was saved


def _stale_token(rid: str, token: int, seen: int | None) -> Reply | None:
    """409 stale_token when a newer token than ``token`` was already seen for the key."""
    if seen is None:
        return None
    return error(
        409,
        rid,
        "idempotency_error",
        "stale_token",
        f"Fencing token {token} is older than {seen} already seen for this key.",
        "X-Fencing-Token",
    )


async def handle_lookup_or_list(request: web.Request) -> web.StreamResponse:
    q = request.query
    key = q.get("idempotency_key")
    a = await arrive(request, key, request.headers.get("X-Fencing-Token"))
    if not isinstance(a, Arrival):
        return a
    state, spec, tenant, entry, rid, rule = a.state, a.spec, a.tenant, a.entry, a.rid, a.rule
    config = state.config
    token_raw = request.headers.get("X-Fencing-Token")
    mode = rule.mode if rule is not None else None
    if (
        config.strict_fencing
        and mode != "ignore_fencing"
        and key is not None
        and token_raw is not None
        and token_raw.isdigit()
    ):
        # A lookup that carries a token fences the key: older tokens are refused from now on.
        state.fencing.observe(tenant, key, int(token_raw))
    if rule is not None:
        if rule.latency_ms:
            await asyncio.sleep(rule.latency_ms / 1000)
    now = state.clock.now()
    if key is not None:
        lag_s = max(config.index_lag_s, rule.lag_s) if rule is not None and mode == "lookup_lag" else config.index_lag_s
        obj = state.objects.find_by_key(tenant, spec.name, key, now, lag_s)
        if obj is None or mode == "lookup_never_finds":
            reply = error(
                404,
                rid,
                "invalid_request_error",
                "resource_missing",
                f"No {spec.object} with idempotency_key {key!r}.",
                "idempotency_key",
            )
        else:
            reply = Reply(200, encode(obj.render(now)), rid, object_id=obj.id)
        return await deliver(request, entry, rule, reply)
    try:
        created_after = float(q["created_after"]) if "created_after" in q else None
        limit = int(q.get("limit", "10"))
        if not 1 <= limit <= 100:
            raise ValueError
    except ValueError:
        reply = error(
            400,
            rid,
            "invalid_request_error",
            "invalid_list_params",
            "created_after must be epoch seconds and limit 1..100.",
        )
        return await deliver(request, entry, rule, reply)
    # Any other parameter filters by a field of the object, as a search by business reference does
    # (GET /v1/refunds?order_id=o-1: every refund of the order, whoever made it).
    filters = {k: v for k, v in q.items() if k not in LIST_PARAMS}
    page, has_more = state.objects.list(
        tenant, spec.name, now, config.index_lag_s, created_after, q.get("starting_after"), limit, filters
    )
    data = {"object": "list", "url": request.path, "has_more": has_more, "data": [o.render(now) for o in page]}
    return await deliver(request, entry, rule, Reply(200, encode(data), rid))


async def handle_retrieve(request: web.Request) -> web.StreamResponse:
    a = await arrive(request, None, None)
    if not isinstance(a, Arrival):
        return a
    state, spec, tenant, entry, rid, rule = a.state, a.spec, a.tenant, a.entry, a.rid, a.rule
    now = state.clock.now()
    obj = state.objects.get(tenant, spec.name, request.match_info["id"], now, state.config.index_lag_s)
    if obj is None:
        reply = error(404, rid, "invalid_request_error", "resource_missing", f"No such {spec.object}.", "id")
    else:
        reply = Reply(200, encode(obj.render(now)), rid, object_id=obj.id)
    return await deliver(request, entry, rule, reply)


async def _ensure_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if "Request-Id" not in response.headers:
        response.headers["Request-Id"] = new_request_id()


def make_app(state: SandboxState) -> web.Application:
    app = web.Application(client_max_size=1024 * 1024)
    app[STATE] = state
    app.on_response_prepare.append(_ensure_request_id)
    app.router.add_post("/v1/{resource}", handle_create)
    app.router.add_get("/v1/{resource}", handle_lookup_or_list)
    app.router.add_get("/v1/{resource}/{id}", handle_retrieve)
    admin.add_routes(app, STATE)
    app.cleanup_ctx.append(_webhook_sender)
    return app


async def _webhook_sender(app: web.Application) -> Any:
    """The signed webhooks' sender (webhooks.py), for as long as the app runs."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_sender(app[STATE], stop))
    yield
    stop.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
