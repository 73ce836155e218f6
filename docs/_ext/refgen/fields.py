"""Pydantic field types, defaults and constraints in words a reader of the reference expects."""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(repr(m.value) for m in annotation)
    if annotation is Path:
        return "path"
    if isinstance(annotation, type):
        return {"str": "text", "bool": "boolean", "int": "integer", "float": "number", "Decimal": "decimal"}.get(
            annotation.__name__, annotation.__name__
        )
    return str(annotation).replace("typing.", "")


def default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return "(empty)" if value == "" else "(none)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if abs(value) < 1e6 else f"{value:.0f}"
    if hasattr(value, "model_dump"):
        return "(defaults below)"
    if isinstance(value, (dict, list)) and not value:
        return "(empty)"
    return str(value)


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <="}


def constraints(info: FieldInfo) -> str:
    out = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return ", ".join(out)
