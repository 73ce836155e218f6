"""The OpenAPI document (``/openapi.json``) as generated clients and schema-driven tests read it.

FastAPI documents the bodies it parses itself. The routes that read their body with the ledger's
exact JSON reader (so that an amount never passes through a binary float) declare it with
``json_body(Model)`` instead: the model's schema joins the document's components like every other
one and the operation refers to it there, so every ``$ref`` resolves inside the document (a model's
own ``$defs`` would point nowhere once embedded). ``install`` also writes what no route states on
its own: the problem+json shape of every error, the 400 of a body that is not JSON on every
operation that takes one, and the links from an answer to the operations its ids feed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from outbox.service.inputs import BY_MAX
from producer.http.problems import PROBLEM, PROBLEM_SCHEMA

COMPONENTS = "#/components/schemas/"

# Patterns for text the ledger stores (outbox.ledger.intent.require_storable, the envelope's rules), so the
# document refuses what the server refuses: PostgreSQL text holds no NUL, keys and names are trimmed.
# Whitespace is spelled out as Python's str.isspace() has it: ECMA-262's \s (what other tools read)
# differs by a few characters (\x1c-\x1f, \x85, \ufeff).
SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
STORABLE = r"^[^\x00]*$"
NONBLANK = rf"^[^\x00]*[^{SPACE}\x00][^\x00]*$"


def who_field(description: str) -> Any:
    """The ``by`` of an operator's act (an approval, a stop, a resume): who acts, not blank, at most
    BY_MAX characters (the surface records the key that vouches for it beside it)."""
    return Field(min_length=1, max_length=BY_MAX, description=description, json_schema_extra={"pattern": NONBLANK})


TRIMMED = rf"^[^{SPACE}\x00](?:[^\x00]*[^{SPACE}\x00])?$"
OPTIONAL_TRIMMED = rf"^(?:[^{SPACE}\x00](?:[^\x00]*[^{SPACE}\x00])?)?$"  # or empty: the default applies
WORD = rf"^[^{SPACE}\x00]+$"

# Answers of the app-wide handlers (workers/server/app.py) that only some routes can give.
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"description": "the state does not allow it (it moved on meanwhile: read it again)", "content": {PROBLEM: {}}}
}
UNCONFIGURED: dict[int | str, dict[str, Any]] = {
    503: {"description": "this server has no actions file (OUTBOX_ACTIONS_FILE)", "content": {PROBLEM: {}}}
}

_BODIES: dict[str, type[BaseModel]] = {}

# (from path, method, its answers) -> link name -> (to path, method, the target's parameters).
# Parameters are OpenAPI runtime expressions (or literals: a wait that answers at once).
_LINKS: dict[tuple[str, str, tuple[str, ...]], dict[str, tuple[str, str, dict[str, Any]]]] = {
    ("/v1/intents", "post", ("201", "200")): {
        "GetOperation": ("/v1/operations/{operation_id}", "get", {"operation_id": "$response.body#/operation_id"}),
        "WaitOperation": (
            "/v1/operations/{operation_id}/wait",
            "get",
            {"operation_id": "$response.body#/operation_id", "timeout_s": 0},
        ),
        "CancelOperation": (
            "/v1/operations/{operation_id}/cancel",
            "post",
            {"operation_id": "$response.body#/operation_id"},
        ),
        "ListByKey": ("/v1/operations", "get", {"idempotency_key": "$response.body#/idempotency_key"}),
        "ApproveOperation": (
            "/v1/approvals/{operation_id}/approve",
            "post",
            {"operation_id": "$response.body#/operation_id"},
        ),
        "DenyOperation": (
            "/v1/approvals/{operation_id}/deny",
            "post",
            {"operation_id": "$response.body#/operation_id"},
        ),
    },
    ("/v1/operations/{operation_id}/cancel", "post", ("200",)): {
        "GetOperation": ("/v1/operations/{operation_id}", "get", {"operation_id": "$response.body#/operation_id"}),
    },
    ("/v1/runs", "post", ("201", "200")): {
        "GetRun": ("/v1/runs/{run_id}", "get", {"run_id": "$response.body#/run_id"}),
        "CancelRun": ("/v1/runs/{run_id}/cancel", "post", {"run_id": "$response.body#/run_id"}),
    },
    ("/v1/runs/{run_id}/cancel", "post", ("200",)): {
        "GetRun": ("/v1/runs/{run_id}", "get", {"run_id": "$response.body#/run_id"}),
    },
    ("/v1/operations", "get", ("200",)): {
        "GetFirst": (
            "/v1/operations/{operation_id}",
            "get",
            {"operation_id": "$response.body#/operations/0/operation_id"},
        ),
    },
    ("/v1/approvals", "get", ("200",)): {
        "ApproveFirst": (
            "/v1/approvals/{operation_id}/approve",
            "post",
            {"operation_id": "$response.body#/approvals/0/operation_id"},
        ),
        "DenyFirst": (
            "/v1/approvals/{operation_id}/deny",
            "post",
            {"operation_id": "$response.body#/approvals/0/operation_id"},
        ),
    },
    ("/v1/handoffs", "get", ("200",)): {
        "GetFirst": ("/v1/handoffs/{handoff_id}", "get", {"handoff_id": "$response.body#/handoffs/0/handoff_id"}),
    },
    ("/v1/breakers", "get", ("200",)): {
        "ResetFirst": ("/v1/breakers/{target}/reset", "post", {"target": "$response.body#/breakers/0/target"}),
    },
}


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its JSON body itself: the body is ``model``."""
    _BODIES[model.__name__] = model
    schema = {"$ref": COMPONENTS + model.__name__}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI) -> None:
    """Serve the completed document from ``/openapi.json`` (built once, on the first request)."""
    generate = app.openapi

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete(generate())
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]  # FastAPI's documented way to extend it


def complete(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's document with the self-read bodies' schemas, the problem shape, the 400s and the links."""
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "validation") for m in _BODIES.values()], ref_template=COMPONENTS + "{model}")
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    schemas["Problem"] = PROBLEM_SCHEMA
    for operation in _operations(doc):
        responses = operation.setdefault("responses", {})
        if "requestBody" in operation:
            malformed = "the body is not JSON (empty, not UTF-8, or a syntax error); the problem says what"
            responses.setdefault("400", {"description": malformed, "content": {PROBLEM: {}}})
        for answer in responses.values():
            if PROBLEM in answer.get("content", {}):
                answer["content"][PROBLEM] = {"schema": {"$ref": COMPONENTS + "Problem"}}
    for (path, method, answers), links in _LINKS.items():
        operation = doc["paths"][path][method]  # KeyError: a link names a route that moved
        for status in answers:
            answer = operation["responses"][status]
            for name, (target, target_method, parameters) in links.items():
                if target_method not in doc["paths"].get(target, {}):
                    raise KeyError(f"link {name} from {method.upper()} {path}: no {target_method.upper()} {target}")
                ref = "#/paths/" + target.replace("~", "~0").replace("/", "~1") + "/" + target_method
                answer.setdefault("links", {})[name] = {"operationRef": ref, "parameters": parameters}
    return doc


def _operations(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and "responses" in operation:
                yield operation
