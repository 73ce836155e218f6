"""Errors as RFC 9457 ``application/problem+json``: ``type``, ``title``, ``status``, ``detail`` and,
for invalid input, ``field`` (the offending field, as the CLI names it). A conflict also names what
holds the key (``idempotency_key`` and ``operation_id``; ``run_key`` and ``run_id``), as extension
members a client reads without parsing the detail (producer/remote/problems.py)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from outbox.errors import BudgetExhausted, IdempotencyConflict, ObjectBusy, Refused, SubjectStopped

PROBLEM = "application/problem+json"
PROBLEM_BASE = "https://agent-outbox.dev/problems/"


class Problem(Exception):
    """An error answered as problem+json."""

    def __init__(
        self,
        status: int,
        kind: str,
        title: str,
        detail: str,
        *,
        field: str | None = None,
        headers: Any = None,
        members: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.title, self.detail, self.field = status, kind, title, detail, field
        self.headers = headers or {}
        self.members = members or {}  # RFC 9457 extension members

    def body(self) -> dict[str, Any]:
        out = {"type": PROBLEM_BASE + self.kind, "title": self.title, "status": self.status, "detail": self.detail}
        if self.field is not None:
            out["field"] = self.field
        return self.members | out


def problem_response(p: Problem) -> JSONResponse:
    return JSONResponse(p.body(), status_code=p.status, media_type=PROBLEM, headers=p.headers)


# The shape of every problem body, for the OpenAPI document (producer/http/openapi.py).
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": PROBLEM_BASE + "<kind>, e.g. invalid, not-found, malformed-body"},
        "title": {"type": "string"},
        "status": {"type": "integer", "description": "the HTTP status code, repeated"},
        "detail": {"type": "string", "description": "what went wrong, for people"},
        "field": {"type": "string", "description": "the offending field (invalid input)"},
        "idempotency_key": {"type": "string", "description": "an idempotency conflict's key"},
        "operation_id": {"type": "string", "description": "the operation that holds that key"},
        "run_key": {"type": "string", "description": "a run conflict's run key"},
        "run_id": {"type": "string", "description": "the run that holds that run key"},
        "outcome": {"type": "string", "description": "REFUSED: a rule of the actions file refused it; nothing stored"},
        "budget": {"type": "object", "description": "a refused call's conversation budgets: what is left"},
        "waiting_on": {"type": "object", "description": "the operation its business object waits behind"},
        "stopped": {
            "type": "object",
            "description": "a stopped subject's stop: subject, stopped_by, stopped_at, reason",
        },
    },
}


def malformed_body(detail: str) -> Problem:
    """A body that is not JSON at all: 400, the same on every route, whoever parses the body."""
    return Problem(400, "malformed-body", "Malformed body", detail, field="body")


def not_found(what: str) -> Problem:
    return Problem(404, "not-found", "Not found", f"no {what} with that id for this key's tenant")


def conflict_problem(exc: IdempotencyConflict) -> Problem:
    return Problem(
        409,
        "idempotency-conflict",
        "Idempotency conflict",
        str(exc),
        field="idempotency_key",
        members={"idempotency_key": exc.key, "operation_id": exc.operation_id},
    )


def refused_problem(exc: Refused) -> Problem:
    """A submit refused by the actions file's rules (a conversation's budget, a busy business object)
    or by an operator's stop of its subject: 409, nothing stored; the detail is the sentence a model reads."""
    members: dict[str, Any] = {"outcome": exc.outcome}
    kind, title = "refused", "Refused"
    if isinstance(exc, BudgetExhausted):
        kind, title = "budget-exhausted", "Budget exhausted"
        members["budget"] = exc.left
    if isinstance(exc, SubjectStopped):
        kind, title = "subject-stopped", "Subject stopped"
        members["stopped"] = exc.as_dict()
    if isinstance(exc, ObjectBusy):
        kind, title = "object-busy", "Object busy"
        members["waiting_on"] = {
            "operation_id": exc.blocking_operation_id,
            "status": exc.blocking_status,
            "object": exc.object_key,
        }
    return Problem(409, kind, title, exc.model_message, members=members)
