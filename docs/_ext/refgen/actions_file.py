"""Every key of the actions file (``OUTBOX_ACTIONS_FILE``), walked from its pydantic models
(workers/provider/actions.py ``ActionsFile`` and the specs it holds): path, type, default, meaning."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from refgen.comments import field_comments
from refgen.fields import constraints, default_text, type_name
from refgen.markdown import GENERATED, code, joined, table


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The models a field holds, with the path step to reach them ("" for itself, ".<name>" in a map,
    "[]" in a list)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin is dict and len(args) == 2:
        return [(".<name>" + step, m) for step, m in _models_in(args[1])]
    if origin in (list, tuple):
        return [("[]" + step, m) for a in args[:1] for step, m in _models_in(a)]
    return [pair for a in args for pair in _models_in(a)]


def _walk(model: type[BaseModel], path: str, stack: tuple[type, ...], rows: list[tuple[str, ...]]) -> None:
    comments = field_comments(model)
    for name, info in model.model_fields.items():
        key = info.validation_alias if isinstance(info.validation_alias, str) else (info.alias or name)
        where = f"{path}.{key}" if path else key
        meaning = joined(info.description or "", comments.get(name, ""))
        bounds = constraints(info)
        rows.append(
            (code(where), type_name(info.annotation) + (f" ({bounds})" if bounds else ""), default_text(info), meaning)
        )
        for step, inner in _models_in(info.annotation):
            if inner not in stack:
                _walk(inner, where + step, (*stack, inner), rows)


def render() -> str:
    from workers.provider.actions import ActionsFile

    rows: list[tuple[str, ...]] = []
    _walk(ActionsFile, "", (ActionsFile,), rows)
    return "\n".join([GENERATED.format(name="actions_file"), "", *table(("key", "type", "default", "meaning"), rows)])
