"""What agent runtimes call for multi-step runs: submit a run, read it, cancel it (outbox/runs/lifecycle.py).

The run's key is the caller's business key for the whole task; each step's idempotency key is
derived from it (``{run_key}:{step}``). Resubmitting the same run answers 200 with it; a changed run
under the same key is 409.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from outbox.access.keys import Caller
from outbox.errors import InvalidIntent
from outbox.ledger.intent import MAX_KEY_LEN, MAX_PRIORITY, MAX_SECONDS, MIN_PRIORITY
from outbox.runs.lifecycle import submit_run
from outbox.runs.spec import COMPENSATE, MAX_RUN_ATTEMPTS, MAX_STEPS
from outbox.service import runs
from producer.http.auth import require, state
from producer.http.bodies import exact_json
from producer.http.intents import PROBLEMS, _threaded, subject_of
from producer.http.openapi import CONFLICT, OPTIONAL_TRIMMED, SPACE, TRIMMED, WORD, json_body

router = APIRouter(prefix="/v1", tags=["runs"])
# Trimmed text without ':' that is not the word the compensation's key uses (outbox/runs/spec.py).
STEP_NAME = rf"^(?!{COMPENSATE}$)[^{SPACE}\x00:](?:[^\x00:]*[^{SPACE}\x00:])?$"


class CompensateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: str = Field(max_length=200, json_schema_extra={"pattern": WORD})
    args: dict[str, Any] = Field(default_factory=dict)


class StepIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        max_length=64,
        description="unique in the run, no ':', not 'compensate'; the step's key is {run_key}:{name}",
        json_schema_extra={"pattern": STEP_NAME},
    )
    action: str = Field(max_length=200, json_schema_extra={"pattern": WORD})
    args: dict[str, Any] = Field(default_factory=dict)
    compensate: CompensateIn | None = Field(default=None, description="undoes this step")


class BudgetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int | None = Field(default=None, ge=1, le=MAX_RUN_ATTEMPTS)
    deadline_s: float | None = Field(default=None, gt=0, le=MAX_SECONDS)


class RunIn(BaseModel):
    """A run (the tenant is the key's)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "run_key": "po-81",
                    "steps": [
                        {
                            "name": "refund",
                            "action": "payments.refund.create",
                            "args": {"order_id": "o-81", "amount": "25.00", "currency": "EUR"},
                        }
                    ],
                }
            ]
        },
    )

    run_key: str = Field(
        max_length=MAX_KEY_LEN,
        description="a stable business key for the whole task, e.g. po-81",
        json_schema_extra={"pattern": TRIMMED},
    )
    steps: list[StepIn] = Field(min_length=1, max_length=MAX_STEPS)
    budget: BudgetIn | None = Field(default=None, description="across all steps")
    priority: int = Field(
        default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="every step's priority (higher is claimed sooner)"
    )
    subject: str | None = Field(default=None, max_length=255, json_schema_extra={"pattern": OPTIONAL_TRIMMED})


class RunOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    run_id: str
    run_key: str
    status: str
    steps: list[dict[str, Any]]
    outcome: str
    model_message: str


class CancelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    compensate: bool = False


def _run(request: Request, caller: Caller, run_id: str) -> dict[str, Any]:
    with state(request).sessions() as session:
        return runs.read(session, caller.tenant, run_id)


def _nullable(field: str) -> bool:
    """Whether RunIn's document allows null for ``field`` (a type ``X | None``)."""
    return not RunIn.model_fields[field].is_required() and type(None) in get_args(RunIn.model_fields[field].annotation)


@router.post(
    "/runs",
    status_code=201,
    response_model=RunOut,
    responses={
        200: {"description": "the same run, already submitted"},
        409: {"description": "run key used for another run"},
        **PROBLEMS,
    },
    openapi_extra=json_body(RunIn),
)
async def post_run(request: Request, caller: Annotated[Caller, Depends(require("submit"))]) -> JSONResponse:
    """Submit a run: its steps run in order, each once; 201 when new, 200 when the same run exists."""
    st = state(request)
    body = exact_json(await request.body())
    if not isinstance(body, dict):
        raise InvalidIntent("body", "must be a JSON object {run_key, steps, budget?}")
    if "tenant" in body:
        raise InvalidIntent("tenant", "the tenant is the API key's; leave it out")
    unknown = sorted(set(body) - set(RunIn.model_fields))
    if unknown:
        raise InvalidIntent(unknown[0], f"unknown field; allowed: {', '.join(RunIn.model_fields)}")

    # null where the document does not allow it (RunIn: priority an integer, budget an object, subject a
    # string, each optional) is refused naming the field, not read as "left out".
    for name in ("priority", "budget", "subject"):
        if name in body and body[name] is None and not _nullable(name):
            raise InvalidIntent(name, "must not be null; leave it out for the default")

    def run() -> tuple[int, str]:
        with st.sessions.begin() as session:
            receipt = submit_run(
                session,
                tenant=caller.tenant,
                run_key=body.get("run_key"),  # type: ignore[arg-type]
                steps=body.get("steps"),  # type: ignore[arg-type]
                budget=body.get("budget"),
                subject=subject_of(body, caller),
                submitted_by=caller.identity,
                rules=st.rules,  # type: ignore[arg-type]
                priority=body.get("priority", 0),
            )
        return (201 if receipt.new else 200), receipt.run_id

    code, run_id = await _threaded(run)
    return JSONResponse(_run(request, caller, run_id), status_code=code)


@router.get("/runs/{run_id}", response_model=RunOut, responses=PROBLEMS)
def get_run(run_id: str, request: Request, caller: Annotated[Caller, Depends(require("read"))]) -> dict[str, Any]:
    """A run: its steps with their states, what holds it and why, the budget used, the outcome."""
    return _run(request, caller, run_id)


@router.post(
    "/runs/{run_id}/cancel",
    response_model=RunOut,
    responses=PROBLEMS | CONFLICT,
    openapi_extra=json_body(CancelIn, required=False),
)
async def post_cancel(
    request: Request, run_id: str, caller: Annotated[Caller, Depends(require("submit"))]
) -> dict[str, Any]:
    """Cancel future steps (a step in flight keeps its late result); ``{"compensate": true}`` also
    undoes completed steps in reverse order."""
    _run(request, caller, run_id)  # 404 for another tenant's
    body = exact_json(await request.body()) if await request.body() else {}
    if not isinstance(body, dict) or set(body) - {"compensate"} or not isinstance(body.get("compensate", False), bool):
        raise InvalidIntent("compensate", 'send {"compensate": true|false} or no body')

    def run() -> None:
        with state(request).sessions.begin() as session:
            runs.cancel(
                session,
                caller.tenant,
                run_id,
                actor=f"api:key-{caller.key_id}",
                compensate=bool(body.get("compensate")),
                reason="cancel requested over the API",
                irreversible=getattr(state(request).rules, "irreversible", frozenset()),
            )

    await _threaded(run)
    return _run(request, caller, run_id)
