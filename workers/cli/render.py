"""How every command shows what it read: a table for people, or ``--json`` for scripts (stable:
sorted keys, two-space indents; errors go to stderr, never into the JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

# Wide enough for an operation id, a key and a status side by side; a wider terminal gets more.
WIDTH = 160

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def console() -> Console:
    return Console(highlight=False, soft_wrap=False, width=max(Console().width, WIDTH))


def emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """A table of ``rows`` (None shows as an empty cell)."""
    out = Table(title=title)
    for name in columns:
        out.add_column(name, overflow="fold")
    for row in rows:
        out.add_row(*("" if v is None else str(v) for v in row))
    return out


def listing(rows: list[dict[str, Any]], *, as_json: bool, title: str, columns: Sequence[Column]) -> int:
    """A listing command's output: ``rows`` as JSON, or a table of ``columns`` (a name and how to
    read the cell from a row) under ``title`` ({n}: how many rows)."""
    if as_json:
        emit_json(rows)
        return 0
    shown = table(
        title.format(n=len(rows)), [name for name, _ in columns], ([cell(r) for _, cell in columns] for r in rows)
    )
    console().print(shown)
    return 0
