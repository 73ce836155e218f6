"""Small Markdown writers shared by the generators: table cells, tables, literals."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(text: object) -> str:
    """One table cell: a single line, pipes escaped, and angle brackets outside literals kept as text
    (``<name>`` would otherwise be read as an HTML tag)."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def joined(*texts: str) -> str:
    """Sentences from several sources (a field's description, the comment above it), each ended."""
    out = []
    for text in texts:
        text = text.strip()
        if text:
            out.append(text if text[-1] in ".!?)" else text + ".")
    return " ".join(out)


def code(text: object) -> str:
    """An inline literal that survives backticks in the text."""
    s = str(text)
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


GENERATED = "<!-- Generated at build time by docs/_ext/refgen/{name}.py from the code: do not edit. -->"
