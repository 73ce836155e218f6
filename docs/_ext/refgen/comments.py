"""The comments written above (or beside) each field (or enum member) of a class: what a pydantic model's source says
of a field when its ``description`` is empty (the house style puts the why in comments)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache


@cache
def field_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    tree = ast.parse(source)
    klass = tree.body[0]
    assert isinstance(klass, ast.ClassDef)
    out: dict[str, str] = {}
    for node in klass.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id  # an enum member
        else:
            continue
        above: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        end = lines[(node.end_lineno or node.lineno) - 1]
        beside = end.split("  # ", 1)[1].strip() if "  # " in end else ""
        text = " ".join(part for part in (" ".join(above), beside) if part)
        if text:
            out[name] = text
    return out
