"""The HTTP API from the FastAPI app's own OpenAPI document (workers/server/app.py): every route, its
scope, body, answers and problem types, and every schema of the document. The document itself is
published beside the site as openapi.json."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from refgen.markdown import GENERATED, cell, code, table

METHODS = ("get", "post", "put", "patch", "delete")


def document() -> dict[str, Any]:
    from outbox.settings import Settings
    from workers.server.app import create_app

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), database_url=f"sqlite:///{tmp}/docs.db")
        return create_app(settings).openapi()


def _ref_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if schema.get("type") == "array" and "items" in schema:
        return f"list of {_ref_name(schema['items'])}"
    if "anyOf" in schema:
        return " | ".join(_ref_name(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    return str(schema.get("type", "any"))


def _anchor(name: str) -> str:
    return f"[{name}](#schema-{name.lower()})"


def _schema_link(schema: dict[str, Any]) -> str:
    name = _ref_name(schema)
    return _anchor(name) if "$ref" in schema else code(name)


def _responses(op: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for status, answer in sorted(op.get("responses", {}).items()):
        content = answer.get("content", {})
        kinds = []
        for media, body in content.items():
            schema = body.get("schema", {})
            kinds.append(f"{code(media)} {_schema_link(schema) if schema else ''}".strip())
        rows.append((code(status), cell(answer.get("description", "")) + (" — " + ", ".join(kinds) if kinds else "")))
    return rows


def render() -> tuple[str, str]:
    doc = document()
    out = [GENERATED.format(name="http_api"), ""]
    out += [
        f"{doc['info'].get('description', '')} OpenAPI {doc.get('openapi')}, version {doc['info'].get('version')}.",
        "",
    ]
    out += ["## Routes", ""]
    out += table(
        ("method", "path", "summary"),
        [
            (m.upper(), code(p), op.get("summary", ""))
            for p, item in doc["paths"].items()
            for m, op in item.items()
            if m in METHODS
        ],
    )
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method not in METHODS:
                continue
            out += [f"### {method.upper()} `{path}`", ""]
            if op.get("summary"):
                out += [f"**{op['summary']}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters", [])
            if params:
                out += table(
                    ("parameter", "in", "type", "required", "meaning"),
                    [
                        (
                            code(p["name"]),
                            p["in"],
                            code(_ref_name(p.get("schema", {}))),
                            "yes" if p.get("required") else "",
                            p.get("description", ""),
                        )
                        for p in params
                    ],
                )
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                out += [f"Body ({code(media)}): {_schema_link(content.get('schema', {}))}", ""]
            out += table(("status", "answer"), _responses(op))
    out += ["## Schemas", ""]
    for name, schema in sorted(doc.get("components", {}).get("schemas", {}).items()):
        out += [f"({'schema-' + name.lower()})=", f"### {name}", ""]
        if schema.get("description"):
            out += [cell(schema["description"]), ""]
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if props:
            out += table(
                ("field", "type", "required", "meaning"),
                [
                    (
                        code(field),
                        _schema_link(s) if "$ref" in s else code(_ref_name(s)),
                        "yes" if field in required else "",
                        s.get("description", s.get("title", "")) if s.get("description") else "",
                    )
                    for field, s in props.items()
                ],
            )
        elif "enum" in schema:
            out += [", ".join(code(v) for v in schema["enum"]), ""]
    return "\n".join(out), json.dumps(doc, indent=2)
