"""Masking: what a person or a tool reads never carries what an action marks sensitive.

Two tools, both pure:

- **paths**: ``customer.email`` (a field of a nested object), ``items[].card`` (that field in every
  element of a list), ``token`` (a top-level field). ``mask_paths`` replaces the value found there
  (whatever its type) with ``***``. Used for the arguments an action marks ``sensitive_args`` and
  the provider's answers its ``sensitive_response_fields`` name.
- **values**: a provider may echo an argument anywhere (an error text, a field we did not name).
  ``Redactor`` replaces every occurrence of a sensitive argument's value in text and JSON with
  ``***``, so what the ledger stores about an attempt (its error, its response) holds no secret
  the agent handed us.

The arguments themselves stay in the ledger unmasked (they are what dispatch sends) until
``agent-outbox purge`` removes them; every output that shows them masks them first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MASK = "***"
# A value this short would mask ordinary words ("yes", an amount "12"); such values are still
# masked where their path is named, only not hunted for in free text.
MIN_REDACTED_LEN = 4
_SEGMENT = re.compile(r"^[A-Za-z0-9_\-$@]+(\[\])?$")


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a masking path (``a.b``, ``items[].card``), or None."""
    if not isinstance(path, str) or not path:
        return "a path must be a non-empty string such as 'customer.email' or 'items[].card'"
    bad = [seg for seg in path.split(".") if not _SEGMENT.match(seg)]
    if bad:
        return f"{path!r}: segment {bad[0]!r} is not a field name (optionally followed by [])"
    return None


def top_field(path: str) -> str:
    """The top-level argument a path starts at (``customer`` of ``customer.email``)."""
    return path.split(".", 1)[0].removesuffix("[]")


def _steps(path: str) -> list[tuple[str, bool]]:
    return [(seg.removesuffix("[]"), seg.endswith("[]")) for seg in path.split(".")]


def mask_paths(value: Any, paths: Sequence[str]) -> Any:
    """A copy of ``value`` with what every path points at replaced by ``***`` (missing paths are
    skipped; the input is not modified)."""
    out = _copy(value)
    for path in paths:
        _mask(out, _steps(path))
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _mask(node: Any, steps: list[tuple[str, bool]]) -> None:
    if not steps or not isinstance(node, dict):
        return
    (name, each), rest = steps[0], steps[1:]
    if name not in node:
        return
    if each:
        items = node[name]
        if not isinstance(items, list):
            # Not the list the path expects: mask the same field inside an object all the same.
            if rest:
                _mask(items, rest)
            else:
                node[name] = MASK
            return
        for i, item in enumerate(items):
            if rest:
                _mask(item, rest)
            else:
                items[i] = MASK
        return
    if rest:
        _mask(node[name], rest)
    else:
        node[name] = MASK


def values_at(value: Any, paths: Sequence[str]) -> Iterator[Any]:
    """Every value the paths point at (lists and objects under them included whole)."""
    for path in paths:
        yield from _values(value, _steps(path))


def _values(node: Any, steps: list[tuple[str, bool]]) -> Iterator[Any]:
    if not steps:
        yield node
        return
    if not isinstance(node, dict) or steps[0][0] not in node:
        return
    (name, each), rest = steps[0], steps[1:]
    child = node[name]
    if each and isinstance(child, list):
        for item in child:
            yield from _values(item, rest)
    else:
        yield from _values(child, rest)


def _leaves(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif value is not None and not isinstance(value, bool):
        yield str(value)


@dataclass(frozen=True)
class Redactor:
    """Replaces sensitive values wherever they appear in text or JSON."""

    values: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: Any, paths: Sequence[str]) -> Redactor:
        found = {leaf for v in values_at(args, paths) for leaf in _leaves(v) if len(leaf) >= MIN_REDACTED_LEN}
        # As a provider may echo them inside JSON text: escaped ("\u00e9", "\/").
        found |= {json.dumps(v)[1:-1] for v in list(found)} | {
            json.dumps(v, ensure_ascii=False)[1:-1] for v in list(found)
        }
        return cls(tuple(sorted(found, key=len, reverse=True)))  # longest first: no partial leftovers

    def __bool__(self) -> bool:
        return bool(self.values)

    def text(self, text: str | None) -> str | None:
        if not text or not self.values:
            return text
        for v in self.values:
            text = text.replace(v, MASK)
        # An excerpt cut inside a secret: its beginning at the very end of the text goes too.
        for v in self.values:
            for n in range(len(v) - 1, MIN_REDACTED_LEN - 1, -1):
                if text.endswith(v[:n]):
                    return text[: len(text) - n] + MASK
        return text

    def json(self, value: Any) -> Any:
        if not self.values:
            return value
        if isinstance(value, dict):
            return {k: self.json(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.json(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        if value is not None and not isinstance(value, bool) and str(value) in self.values:
            return MASK
        return value


def masked_view(value: Any, paths: Iterable[str], redactor: Redactor | None = None) -> Any:
    """``value`` with ``paths`` masked, then any sensitive value left anywhere redacted."""
    out = mask_paths(value, list(paths))
    return redactor.json(out) if redactor else out
