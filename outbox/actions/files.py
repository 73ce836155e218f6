"""Reading an actions file: the error that names each bad field, and ``${VAR}`` references.

Both the producer's rules (outbox/actions/rules.py) and the workers' whole file
(workers/provider/actions.py) read the same file the same way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from outbox.errors import ConfigError

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ActionsFileError(ConfigError, ValueError):
    """The actions file is missing or malformed; the message names the file and each bad field."""

    def __init__(self, path: str | os.PathLike[str], problems: list[tuple[str, str]]) -> None:
        self.path = str(path)
        self.problems = problems  # (dotted field path, message)
        lines = "; ".join(f"{field}: {msg}" if field else msg for field, msg in problems)
        super().__init__(f"{self.path}: {lines}")


def unset_message(name: str) -> str:
    return f"environment variable {name} is not set"


def resolve_env(
    value: Any,
    environ: Mapping[str, str],
    path: str,
    problems: list[tuple[str, str]],
    unset: list[tuple[str, str]] | None = None,
) -> Any:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string of a parsed YAML tree. A variable that
    is not set (and has no default) becomes "" and a problem, or, given ``unset``, an entry
    (path, VAR) there instead: whoever reads the file decides whether that is an error."""
    if isinstance(value, dict):
        return {
            k: resolve_env(v, environ, f"{path}.{k}" if path else str(k), problems, unset) for k, v in value.items()
        }
    if isinstance(value, list):
        return [resolve_env(v, environ, f"{path}.{i}", problems, unset) for i, v in enumerate(value)]
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in environ:
                return environ[name]
            if default is not None:
                return default
            if unset is not None:
                unset.append((path, name))
            else:
                problems.append((path, unset_message(name)))
            return ""

        return _ENV_REF.sub(sub, value)
    return value


def duplicate_keys(text: str) -> list[tuple[str, str]]:
    """(dotted path, message) for each key a mapping of the YAML ``text`` declares twice: YAML keeps
    the last one silently, so a second action of the same name would replace the first unseen."""
    problems: list[tuple[str, str]] = []

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}.{i}")
        if not isinstance(node, yaml.MappingNode):
            return
        lines: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
            where = f"{path}.{name}" if path else name
            line = key.start_mark.line + 1
            if name in lines:
                problems.append((where, f"declared twice (lines {lines[name]} and {line}); YAML keeps the last"))
            lines.setdefault(name, line)
            walk(value, where)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return problems


def read_yaml(path: str | os.PathLike[str]) -> tuple[Any, list[tuple[str, str]]]:
    """The file's YAML tree and its keys declared twice; ActionsFileError when it cannot be read or
    is not YAML."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ActionsFileError(path, [("", f"cannot read the file: {exc.strerror or exc}")]) from exc
    try:
        return yaml.safe_load(text), duplicate_keys(text)
    except yaml.YAMLError as exc:
        raise ActionsFileError(path, [("", f"not valid YAML: {exc}")]) from exc


class UnknownAction(ConfigError, KeyError):
    """No action of that name is declared in the actions file."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name, self.known = name, sorted(known)
        super().__init__(f"unknown action {name!r}; known actions: {', '.join(self.known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0])
