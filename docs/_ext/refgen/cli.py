"""Every command and flag of ``agent-outbox``, read from its argparse parsers (workers/cli/main.py)."""

from __future__ import annotations

import argparse
import os

from refgen.markdown import GENERATED, cell, code, table


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return names
        metavar = action.metavar or action.dest.upper()
        return f"{names} {metavar if isinstance(metavar, str) else ' '.join(metavar)}"
    metavar = action.metavar or action.dest
    return str(metavar if isinstance(metavar, str) else " ".join(metavar))


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)


def _default(action: argparse.Action) -> str:
    if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS, [], ""):
        return str(action.default)
    return ""


def _walk(parser: argparse.ArgumentParser, path: list[str], about: str, out: list[str]) -> None:
    depth = len(path)
    title = " ".join(path)
    out += [f"{'#' * min(depth + 2, 6)} `{title}`", ""]
    text = about or parser.description or ""
    if text:
        out += [cell(text), ""]
    out += ["```text", parser.format_usage().strip().removeprefix("usage: "), "```", ""]
    rows = []
    sub: argparse._SubParsersAction | None = None  # type: ignore[type-arg]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action
            continue
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        rows.append((code(_flags(action)), _help(parser, action), code(_default(action)) if _default(action) else ""))
    if rows:
        out += table(("argument", "meaning", "default"), rows)
    if sub is not None:
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        seen: set[int] = set()
        for name, child in sub.choices.items():
            if id(child) in seen:  # an alias of a command already listed
                continue
            seen.add(id(child))
            _walk(child, [*path, name], helps.get(name, ""), out)


def render() -> str:
    os.environ["COLUMNS"] = "100"  # usage lines wrap at a width a page shows
    from workers.cli.main import build_parser

    parser = build_parser()
    out = [GENERATED.format(name="cli"), ""]
    _walk(parser, ["agent-outbox"], parser.description or "", out)
    return "\n".join(out)
