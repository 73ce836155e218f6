"""The admin API: what tests and the demo use to script faults and count effects.

Admin requests are never faulted and never appear in the request log.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from workers.sandbox.config import SettingError
from workers.sandbox.effects import GROUPINGS, Effect
from workers.sandbox.faults import RuleError, parse_rule
from workers.sandbox.responses import encode, error_body
from workers.sandbox.state import SandboxState

JSON = "application/json"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(data), content_type=JSON)


def _bad(field: str, message: str) -> web.Response:
    return _json(error_body("invalid_request_error", "invalid_admin_request", message, field), 400)


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        raise web.HTTPBadRequest(
            body=encode(error_body("invalid_request_error", "invalid_json", "Body must be JSON.", "body")),
            content_type=JSON,
        ) from None


def add_routes(app: web.Application, key: web.AppKey[SandboxState]) -> None:
    def state(request: web.Request) -> SandboxState:
        return request.app[key]

    async def health(request: web.Request) -> web.Response:
        return _json({"ok": True})

    async def reset(request: web.Request) -> web.Response:
        keep = request.query.get("keep_faults") in ("1", "true")
        state(request).reset(keep_faults=keep)
        return _json({"ok": True})

    async def get_config(request: web.Request) -> web.Response:
        return _json(state(request).config.to_json())

    async def post_config(request: web.Request) -> web.Response:
        body = await _body(request)
        if not isinstance(body, dict):
            return _bad("body", "must be a JSON object of settings")
        s = state(request)
        try:
            s.config.update(body)
        except SettingError as exc:
            return _bad(exc.field, str(exc))
        s.requests.resize(s.config.request_log_max)
        return _json(s.config.to_json())

    async def effects(request: web.Request) -> web.Response:
        q = request.query
        s = state(request)
        rows = s.effects.filter(q.get("resource"), q.get("key"), q.get("tenant"))
        now = s.clock.now()

        def shown(e: Effect) -> dict[str, Any]:
            # What became of the object: pending while processing, then its final or "failed" status.
            obj = s.objects.by_id.get(e.object_id)
            return e.to_json() | {"status": obj.status(now) if obj is not None else None}

        return _json({"count": len(rows), "data": [shown(e) for e in rows]})

    async def duplicates(request: web.Request) -> web.Response:
        by = request.query.get("by", "key")
        if by not in GROUPINGS:
            return _bad("by", f"must be one of {', '.join(GROUPINGS)}")
        groups = state(request).effects.duplicates(by)
        return _json({"by": by, "count": len(groups), "data": groups})

    async def requests(request: web.Request) -> web.Response:
        filters = dict(request.query)
        if "since_seq" in filters and not filters["since_seq"].isdigit():
            return _bad("since_seq", "must be an integer")
        rows = state(request).requests.filter(filters)
        return _json({"count": len(rows), "data": [e.to_json() for e in rows]})

    async def list_faults(request: web.Request) -> web.Response:
        rules = state(request).faults.rules
        return _json({"count": len(rules), "data": [r.to_json() for r in rules]})

    async def add_faults(request: web.Request) -> web.Response:
        body = await _body(request)
        bodies = body if isinstance(body, list) else [body]
        book = state(request).faults
        try:
            # Validate all before adding any, so a bad list leaves the book unchanged.
            for b in bodies:
                parse_rule(b)
        except RuleError as exc:
            return _bad(exc.field, str(exc))
        added = [book.add(b).to_json() for b in bodies]
        return _json(added if isinstance(body, list) else added[0], 201)

    async def clear_faults(request: web.Request) -> web.Response:
        state(request).faults.clear()
        return _json({"ok": True})

    async def delete_fault(request: web.Request) -> web.Response:
        try:
            rule_id = int(request.match_info["id"])
        except ValueError:
            return _bad("id", "must be an integer")
        if not state(request).faults.remove(rule_id):
            return _json(error_body("invalid_request_error", "resource_missing", "No such fault rule.", "id"), 404)
        return _json({"ok": True, "deleted": rule_id})

    async def get_clock(request: web.Request) -> web.Response:
        clock = state(request).clock
        return _json({"now": clock.now(), "offset_s": clock.offset_s})

    async def advance_clock(request: web.Request) -> web.Response:
        body = await _body(request)
        seconds = body.get("advance_s") if isinstance(body, dict) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            return _bad("advance_s", "must be a number >= 0")
        clock = state(request).clock
        clock.advance(float(seconds))
        return _json({"now": clock.now(), "offset_s": clock.offset_s})

    async def webhooks(request: web.Request) -> web.Response:
        rows = [d.to_json() for d in state(request).webhooks.deliveries]
        return _json({"count": len(rows), "data": rows})

    async def release_webhooks(request: web.Request) -> web.Response:
        return _json({"released": state(request).webhooks.release()})

    async def redeliver_webhook(request: web.Request) -> web.Response:
        try:
            delivery_id = int(request.match_info["id"])
        except ValueError:
            return _bad("id", "must be an integer")
        found = state(request).webhooks.redeliver(delivery_id)
        if found is None:
            return _json(error_body("invalid_request_error", "resource_missing", "No such webhook.", "id"), 404)
        return _json(found.to_json())

    r = app.router
    r.add_get("/admin/health", health)
    r.add_post("/admin/reset", reset)
    r.add_get("/admin/config", get_config)
    r.add_post("/admin/config", post_config)
    r.add_get("/admin/effects", effects)
    r.add_get("/admin/duplicates", duplicates)
    r.add_get("/admin/requests", requests)
    r.add_get("/admin/faults", list_faults)
    r.add_post("/admin/faults", add_faults)
    r.add_delete("/admin/faults", clear_faults)
    r.add_delete("/admin/faults/{id}", delete_fault)
    r.add_get("/admin/clock", get_clock)
    r.add_post("/admin/clock", advance_clock)
    r.add_get("/admin/webhooks", webhooks)
    r.add_post("/admin/webhooks/release", release_webhooks)
    r.add_post("/admin/webhooks/{id}/redeliver", redeliver_webhook)
