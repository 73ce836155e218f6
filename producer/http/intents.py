"""What agent runtimes call: submit intents, read operations, wait for an outcome, cancel.

Bodies are parsed with the ledger's exact JSON reader (every number a Decimal, as
``producer.submit`` wants), so an amount never passes through a binary float on the way in.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict
from sqlalchemy.orm import Session

from outbox.access.keys import Caller
from outbox.errors import IdempotencyConflict, InvalidIntent, Refused
from outbox.ledger.intent import MAX_KEY_LEN, MAX_PRIORITY, MAX_SECONDS, MIN_PRIORITY, Intent, validate_priority
from outbox.ledger.states import Status
from outbox.ledger.submit import submit
from outbox.ledger.tracing import validate_traceparent
from outbox.ledger.typed_outcome import SETTLED, Outcome, with_outcome
from outbox.reads.queries import operation_json
from outbox.service import operations, waiting
from producer.http.auth import ApiState, require, state
from producer.http.bodies import exact_json
from producer.http.openapi import CONFLICT, OPTIONAL_TRIMMED, STORABLE, TRIMMED, WORD, json_body
from producer.http.problems import Problem, conflict_problem, refused_problem

router = APIRouter(prefix="/v1", tags=["agents"])
MAX_BATCH = 500


INTENT_EXAMPLE: JsonDict = {
    "action": "payments.refund.create",
    "idempotency_key": "wf-81:invoice-17:refund-2:v1",
    "args": {"order_id": "o-17", "amount": "25.00", "currency": "EUR"},
}


class IntentIn(BaseModel):
    """One intent (the tenant is the key's)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [INTENT_EXAMPLE]})

    action: str = Field(
        max_length=200,
        description="a named action of the actions file, e.g. payments.refund.create",
        json_schema_extra={"pattern": WORD},
    )
    args: dict[str, Any] = Field(description="the action's arguments; numbers are read as exact decimals")
    idempotency_key: str | None = Field(
        default=None,
        max_length=MAX_KEY_LEN,
        description="a stable business key (or send it as the Idempotency-Key header; one of the two is required)",
        json_schema_extra={"pattern": TRIMMED},
    )
    subject: str | None = Field(
        default=None,
        max_length=255,
        description="who asks (default: api:key-<id>)",
        json_schema_extra={"pattern": OPTIONAL_TRIMMED},
    )
    run_id: str | None = Field(default=None, max_length=255, json_schema_extra={"pattern": STORABLE})
    tool_call_id: str | None = Field(default=None, max_length=255, json_schema_extra={"pattern": STORABLE})
    max_attempts: int | None = Field(default=None, ge=1, le=1000)
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS)
    priority: int = Field(
        default=0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="higher is claimed sooner among this tenant's due intents; stored, not part of the"
        " intent's identity (a resubmit with another priority keeps the first)",
    )


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"intents": [INTENT_EXAMPLE]}]})

    intents: list[IntentIn] = Field(max_length=MAX_BATCH)


class OperationOut(BaseModel):
    """An operation: the fields of ``agent-outbox ops show --json`` plus the typed outcome."""

    model_config = ConfigDict(extra="allow")

    operation_id: str
    tenant: str
    idempotency_key: str
    provider_key: str
    action: str
    status: str
    outcome: str = Field(description="SUCCEEDED | FAILED_BEFORE_COMMIT | UNKNOWN | NEEDS_HUMAN | ...")
    stage: str | None = Field(
        default=None, description="with PENDING: QUEUED (nothing sent yet) | IN_PROGRESS | ACCEPTED (by the provider)"
    )
    model_message: str = Field(description="one sentence a language model can act on")


class BatchItemOut(BaseModel):
    index: int
    status: int
    operation: dict[str, Any] | None = None
    problem: dict[str, Any] | None = None


class BatchOut(BaseModel):
    results: list[BatchItemOut]


class PageOut(BaseModel):
    operations: list[dict[str, Any]]
    next_cursor: str | None


PROBLEMS: dict[int | str, dict[str, Any]] = {
    code: {"description": what, "content": {"application/problem+json": {}}}
    for code, what in {
        401: "no or unknown API key",
        403: "the key lacks the scope",
        404: "no such operation for this key's tenant",
        413: "body too large",
        422: "invalid input (the problem names the field)",
        429: "rate limited, or the tenant's backlog is full (Retry-After; nothing stored)",
    }.items()
}


SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the same intent, already submitted", "model": OperationOut},
    409: {"description": "the key was used with other arguments", "content": {"application/problem+json": {}}},
    **PROBLEMS,
}


DEADLINE_RULE = f"a positive number of seconds, at most {MAX_SECONDS:.0f} (ten years)"


def _intent_fields(obj: Any, header_key: str | None, caller: Caller, where: str = "") -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InvalidIntent(where or "body", "must be a JSON object")
    if "tenant" in obj:
        raise InvalidIntent(f"{where}tenant", "the tenant is the API key's; leave it out")
    unknown = sorted(set(obj) - set(IntentIn.model_fields))
    if unknown:
        raise InvalidIntent(f"{where}{unknown[0]}", f"unknown field; allowed: {', '.join(IntentIn.model_fields)}")
    key = obj.get("idempotency_key", header_key)
    if header_key is not None and obj.get("idempotency_key") not in (None, header_key):
        raise InvalidIntent(f"{where}idempotency_key", "differs from the Idempotency-Key header; send one")
    out: dict[str, Any] = {
        "tenant": caller.tenant,
        "idempotency_key": key,
        "action": obj.get("action"),
        "args": obj.get("args"),
        "subject": subject_of(obj, caller),
        "submitted_by": caller.identity,
        "run_id": obj.get("run_id"),
        "tool_call_id": obj.get("tool_call_id"),
    }
    if obj.get("max_attempts") is not None:
        m = _bounded(obj["max_attempts"], f"{where}max_attempts", "an integer from 1 to 1000", integer=True)
        if not 1 <= m <= 1000:
            raise InvalidIntent(f"{where}max_attempts", "must be an integer from 1 to 1000")
        out["max_attempts"] = int(m)
    if obj.get("deadline_s") is not None:
        # The document's bound (IntentIn: 0 < deadline_s <= MAX_SECONDS), checked here too: the bodies are
        # read as exact JSON, not through the model, and a batch's items are checked one by one.
        deadline = _bounded(obj["deadline_s"], f"{where}deadline_s", DEADLINE_RULE)
        if not 0 < deadline <= MAX_SECONDS:
            raise InvalidIntent(f"{where}deadline_s", f"must be {DEADLINE_RULE}")
        out["deadline_s"] = float(deadline)
    if "priority" in obj:  # null is not an integer (the document's type): leave it out for 0
        if obj["priority"] is None:  # said as POST /v1/runs says it (producer/http/runs.py)
            raise InvalidIntent(f"{where}priority", "must not be null; leave it out for the default")
        out["priority"] = validate_priority(obj["priority"], f"{where}priority")
    if not isinstance(out["args"], dict):
        raise InvalidIntent(f"{where}args", "required: a JSON object of the action's arguments")
    return out


def trace_header(request: Request) -> str | None:
    """The request's W3C ``traceparent`` header (standard, so not a parameter of the schema);
    422 naming it when malformed: a trace that cannot be continued is a client's bug to see."""
    return validate_traceparent(request.headers.get("traceparent"), "traceparent (header)")


BUDGET_SCOPE_HEADER = "Outbox-Budget-Scope"


def budget_scope_header(request: Request) -> str | None:
    """The conversation (``Outbox-Budget-Scope`` header) whose budget a new intent is charged to, when
    the actions file declares a ``budget_scope`` for its action (outbox/ledger/budget_scopes.py). Read
    from the headers, not a parameter of the schema: most clients never send it."""
    return request.headers.get(BUDGET_SCOPE_HEADER)


def subject_of(obj: dict[str, Any], caller: Caller) -> Any:
    """The body's subject, or the key's name when it gives none (null or ""); anything else is the
    body's to answer for (the ledger refuses what is not text)."""
    subject = obj.get("subject")
    return f"api:key-{caller.key_id}" if subject is None or subject == "" else subject


def _bounded(value: Any, field: str, what: str, *, integer: bool = False) -> Decimal:
    """A JSON number within sane magnitude, checked BEFORE any conversion: int(1e600000) alone
    would hold the server for seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, Decimal)):
        raise InvalidIntent(field, f"must be {what}")
    number = Decimal(value) if isinstance(value, int) else value
    if not number.is_finite() or number.adjusted() > 12 or (integer and number != number.to_integral_value()):
        raise InvalidIntent(field, f"must be {what}")
    return number


def _known_action(st: ApiState, fields: dict[str, Any], where: str = "") -> None:
    """With the actions file at hand, an unknown action is refused now, not by a worker later."""
    action = fields.get("action")
    if st.rules is not None and isinstance(action, str) and st.rules.key_rule(action) is None:
        known = sorted(getattr(st.rules, "actions", {}))
        raise InvalidIntent(f"{where}action", f"unknown action {action!r}; known: {', '.join(known) or '(none)'}")


def _submit_one(st: ApiState, session: Session, intent: Intent, caller: Caller) -> tuple[int, dict[str, Any]]:
    refusal = st.backlog.refusal(session, caller.tenant, intent.idempotency_key)
    if refusal is not None:
        raise refusal
    receipt = submit(session, intent, rules=st.rules)
    return (201 if receipt.new else 200), operations.submitted(session, receipt) | receipt.extras()


@router.post(
    "/intents",
    status_code=201,
    response_model=OperationOut,
    responses=SUBMIT_RESPONSES,
    openapi_extra=json_body(IntentIn),
)
async def post_intent(
    request: Request,
    caller: Annotated[Caller, Depends(require("submit"))],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    """Submit one intent. 201 when new, 200 with the existing operation when the same intent was
    already submitted, 409 when the key was used with other arguments. A W3C `traceparent` header
    is stored with the intent: its spans continue that trace."""
    st = state(request)
    fields = _intent_fields(exact_json(await request.body()), idempotency_key, caller)
    fields["traceparent"] = trace_header(request)
    fields["budget_scope"] = budget_scope_header(request)
    _known_action(st, fields)

    def run() -> tuple[int, dict[str, Any]]:
        intent = Intent(**fields)  # validated here, off the event loop: canonical args cost what parsing did
        with st.sessions.begin() as session:
            return _submit_one(st, session, intent, caller)

    code, op = await _threaded(run)
    return JSONResponse(op, status_code=code)


@router.post(
    "/intents:batch",
    response_model=BatchOut,
    responses=PROBLEMS,
    openapi_extra=json_body(BatchIn),
)
async def post_batch(request: Request, caller: Annotated[Caller, Depends(require("submit"))]) -> JSONResponse:
    """Up to 500 intents in one transaction; one result per item, in order (201/200 with the
    operation, or 409/422/429 with a problem); the good items are stored either way."""
    st = state(request)
    body = exact_json(await request.body())
    if not isinstance(body, dict) or set(body) != {"intents"} or not isinstance(body["intents"], list):
        raise InvalidIntent("intents", 'send {"intents": [intent, ...]}')
    items = body["intents"]
    if len(items) > MAX_BATCH:
        raise InvalidIntent("intents", f"at most {MAX_BATCH} intents per batch (got {len(items)})")
    traceparent = trace_header(request)  # one trace for the batch's intents
    scope = budget_scope_header(request)  # and one conversation

    def run() -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        with st.sessions.begin() as session:
            for i, obj in enumerate(items):
                try:
                    fields = _intent_fields(obj, None, caller, where=f"intents.{i}.")
                    _known_action(st, fields, where=f"intents.{i}.")
                    intent = Intent(**fields, traceparent=traceparent, budget_scope=scope)
                    refusal = st.backlog.refusal(session, caller.tenant, intent.idempotency_key)
                    if refusal is not None:
                        results.append({"index": i, "status": 429, "problem": refusal.body()})
                        continue
                    with session.begin_nested():  # a bad item never takes the good ones down
                        receipt = submit(session, intent, rules=st.rules)
                    results.append({"index": i, "status": 201 if receipt.new else 200, "operation": receipt})
                except InvalidIntent as exc:
                    p = Problem(422, "invalid", "Invalid input", exc.reason, field=exc.field)
                    results.append({"index": i, "status": 422, "problem": p.body()})
                except IdempotencyConflict as exc:
                    results.append({"index": i, "status": 409, "problem": conflict_problem(exc).body()})
                except Refused as exc:
                    results.append({"index": i, "status": 409, "problem": refused_problem(exc).body()})
            # New rows answered from what their inserts wrote; replays read, all in four reads.
            replays = [r["operation"].operation_id for r in results if "operation" in r and not r["operation"].new]
            answers = operations.answers(session, replays, replay=True) if replays else {}
            for r in results:
                if "operation" in r:
                    receipt = r["operation"]
                    r["operation"] = answers.get(receipt.operation_id) or operations.submitted(session, receipt)
        return results

    return JSONResponse({"results": await _threaded(run)})


@router.get("/operations/{operation_id}", response_model=OperationOut, responses=PROBLEMS)
def get_operation(
    operation_id: str, request: Request, caller: Annotated[Caller, Depends(require("read"))]
) -> dict[str, Any]:
    """One operation with its attempt_log, history and typed outcome."""
    with state(request).sessions() as session:
        return operations.read(session, caller.tenant, operation_id)


@router.get("/operations", response_model=PageOut, responses=PROBLEMS)
def list_operations(
    request: Request,
    caller: Annotated[Caller, Depends(require("read"))],
    status: Status | None = None,
    action: str | None = None,
    idempotency_key: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> dict[str, Any]:
    """This tenant's operations, newest first; pass ``next_cursor`` back as ``cursor`` for more."""
    with state(request).sessions() as session:
        found = operations.page(
            session,
            caller.tenant,
            status=status.value if status is not None else None,
            action=action,
            idempotency_key=idempotency_key,
            cursor=cursor,
            limit=limit,
        )
        return {
            "operations": [with_outcome(operation_json(op)) for op in found.operations],
            "next_cursor": found.next_cursor,
        }


@router.get("/operations/{operation_id}/wait", response_model=OperationOut, responses=PROBLEMS)
async def wait_operation(
    operation_id: str,
    request: Request,
    caller: Annotated[Caller, Depends(require("read"))],
    timeout_s: Annotated[float, Query(ge=0, le=waiting.MAX_WAIT_S)] = 30.0,
) -> dict[str, Any]:
    """Long-poll until the outcome is settled (final, or waiting for a person or an approval), or
    ``timeout_s`` (at most 60) passed; either way 200 with the operation as it is then."""
    st = state(request)

    def read() -> dict[str, Any]:
        with st.sessions() as session:
            return operations.read(session, caller.tenant, operation_id)

    op: dict[str, Any] = await _threaded(read)
    if Outcome(op["outcome"]) not in SETTLED and timeout_s > 0:
        await st.waiters.wait(operation_id, timeout_s)
        op = await _threaded(read)
    return op


@router.post("/operations/{operation_id}/cancel", response_model=OperationOut, responses=PROBLEMS | CONFLICT)
def cancel_operation(
    operation_id: str, request: Request, caller: Annotated[Caller, Depends(require("submit"))]
) -> dict[str, Any]:
    """As ``agent-outbox ops cancel``: cancelled if nothing was sent yet; otherwise the request is
    recorded in the history and the operation ends as what really happened."""
    with state(request).sessions.begin() as session:
        operations.cancel(
            session,
            caller.tenant,
            operation_id,
            actor=f"api:key-{caller.key_id}",
            reason="cancel requested over the API",
        )
    with state(request).sessions() as session:
        return operations.read(session, caller.tenant, operation_id)


async def _threaded(fn: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)
