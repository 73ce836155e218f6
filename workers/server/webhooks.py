"""What providers call over HTTP: ``POST /v1/webhooks/{target}`` (and ``/{target}/{tenant}``, a
tenant's own endpoint). No API key: the signature is the authentication (workers/service/webhooks.py).

Answers: 200 once the event is kept (a retry of one kept before: 200 too, ``duplicate``: true, and
nothing changes), 400 malformed or outside the timestamp tolerance, 401 a signature that matches
no secret of the endpoint, 404 no such endpoint; nothing is stored for a 4xx. A 5xx (the ledger
down) is the provider's cue to retry later, which they all do.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from producer.http.problems import PROBLEM, Problem, problem_response
from workers.service.webhooks import EndpointNotFound, WebhookReceiver
from workers.webhooks.signatures import WebhookRefused

router = APIRouter(prefix="/v1", tags=["webhooks"])
# Not length-checked here: a name that is no target (or tenant) of the actions file is a 404, whatever its length.
Target = Annotated[str, Path(description="a target of the actions file")]
Tenant = Annotated[str, Path(description="the tenant whose endpoint this is")]

_ANSWERED = {
    "type": "object",
    "required": ["event_id", "duplicate", "disposition"],
    "properties": {
        "event_id": {"type": "string"},
        "duplicate": {"type": "boolean", "description": "received before: nothing changed"},
        "disposition": {
            "type": "string",
            "enum": ["settled", "recorded", "no_operation", "ambiguous", "ignored"],
            "description": "what the ledger did with it",
        },
    },
}
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the event is kept (or was, before)", "content": {"application/json": {"schema": _ANSWERED}}},
    400: {"description": "malformed, or signed outside the 5-minute tolerance", "content": {PROBLEM: {}}},
    401: {"description": "the signature matches no secret of this endpoint", "content": {PROBLEM: {}}},
    404: {"description": "no webhook endpoint for this target (or tenant)", "content": {PROBLEM: {}}},
    503: {"description": "this server has no actions file (OUTBOX_ACTIONS_FILE)", "content": {PROBLEM: {}}},
}
_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}}


async def _receive(request: Request, target: str, tenant: str | None) -> JSONResponse:
    receiver: WebhookReceiver = request.app.state.webhooks
    body = await request.body()
    try:
        answer = await run_in_threadpool(receiver.receive, target, tenant, dict(request.headers), body)
    except EndpointNotFound as exc:
        return problem_response(Problem(404, "not-found", "Not found", str(exc)))
    except WebhookRefused as exc:
        kind, title = ("bad-signature", "Bad signature") if exc.status == 401 else ("bad-webhook", "Bad webhook")
        return problem_response(Problem(exc.status, kind, title, exc.detail))
    return JSONResponse(answer.as_json())


@router.post("/webhooks/{target}", responses=RESPONSES, openapi_extra=_BODY)
async def webhook(target: Target, request: Request) -> JSONResponse:
    """A provider's event for the target's own endpoint (signed with ``targets.<target>.webhooks.secret``)."""
    return await _receive(request, target, None)


@router.post("/webhooks/{target}/{tenant}", responses=RESPONSES, openapi_extra=_BODY)
async def tenant_webhook(target: Target, tenant: Tenant, request: Request) -> JSONResponse:
    """A provider's event for one tenant's endpoint (signed with its ``webhook_secret``): it settles that
    tenant's operations only."""
    return await _receive(request, target, tenant)
