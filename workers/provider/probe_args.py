"""The probe's other intents: the probe's arguments with one changed, to see what the provider (and
the actions file's lookup) make of a request or an intent that is not the probe's own.

Pure: workers/provider/probe.py sends and looks up with them.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from outbox.actions.matching import KEY_PLACEHOLDER, match_arguments
from workers.provider.actions import ActionConfig

# Where a changed argument's value is told apart from the original (a string argument gets this suffix).
CHANGED_SUFFIX = "-probe-changed"
FREE_FORM = ("id", "ref", "reference", "reason", "note", "description", "memo", "subject", "body")


def changed_args(args: dict[str, Any], cfg: ActionConfig) -> tuple[dict[str, Any], str] | None:
    """The same arguments with one body argument changed, and its name; None if there is nothing to
    change. A free-form string (a reference, a reason) first, so that the changed request is still
    valid and only the key's check can refuse it; then any string; then a whole number."""
    in_path = cfg.request.placeholder_names()
    candidates = [n for n in sorted(args) if n not in in_path and n not in cfg.decimal_args]
    strings = [n for n in candidates if isinstance(args[n], str)]
    for name in sorted(strings, key=lambda n: not n.endswith(FREE_FORM)):
        return {**args, name: args[name] + CHANGED_SUFFIX}, name
    for name in candidates:
        value = args[name]
        if isinstance(value, int) and not isinstance(value, bool):
            return {**args, name: value + 1}, name
    return None


def other_intent(args: dict[str, Any], cfg: ActionConfig) -> dict[str, Any] | None:
    """Another intent that a lookup by business reference must not call the probe's effect its own:
    the arguments with one that ``lookup.match`` compares changed, one the lookup's request does not
    use first (so the provider answers with the probe's effect, and only the match can tell). None:
    no compared argument the probe can change."""
    if cfg.lookup is None:
        return None
    compared = match_arguments(cfg.lookup.match) - {KEY_PLACEHOLDER}
    asked = cfg.lookup.request.placeholder_names()
    for name in sorted(n for n in compared if n in args and n not in asked) + sorted(compared & asked):
        other = _other_value(args[name])
        if other is not None:
            return {**args, name: other}
    return None


def _other_value(value: Any) -> Any:
    """A different value of the same kind: money one unit more, text with a suffix, a number plus one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, Decimal)):
        return value + 1
    if isinstance(value, str):
        try:
            return str(Decimal(value) + 1) if value.strip() and Decimal(value).is_finite() else value + CHANGED_SUFFIX
        except ArithmeticError:
            return value + CHANGED_SUFFIX
    return None
