"""``match:``: which fields of an object found at the provider must equal which arguments of the intent.

A lookup by the provider's key finds what carried our key; a lookup by a business reference (refunds of
an order, tickets by external id) also finds what others made: an earlier partial refund of the same
order is not ours. ``match:`` says how to tell ours apart, as written in the actions file::

    match:
      amount: "{amount}"                                  # a dotted path in the found object: a template
      order_id: "{order_id}"
      currency: {equals: "{currency}", compare: casefold}  # long form: how to compare

The left side is a dotted path into the found object (``refund.amount``; a number steps into a list:
``lines.0.sku``). The right side is a template of the intent's arguments: exactly one placeholder
(``"{amount}"``) stands for the argument's own value, whatever its type; anything else
(``"order-{order_id}"``) is rendered as text. ``{idempotency_key}`` is the key the provider sees.

How two values compare (``compare``):
- ``exact`` (the default): as the provider writes them, except that decimals compare as decimals:
  ``"25.00"``, ``25.0``, ``25`` and ``"25"`` are equal (a string counts as a decimal when it is one
  plainly written: ``-12.50``, ``7``; not ``"007"``, ``"1e3"`` or ``" 25"``, which compare as text).
  ``"EUR"`` and ``"eur"`` differ; ``true`` and ``1`` differ; a field the object lacks never matches.
- ``casefold``: text compared case-insensitively (a currency the provider lower-cases); decimals
  still compare as decimals.

Exact is the default because a wrong "equal" adopts someone else's effect as ours. A wrong "differs"
is not free either: it makes our own object "not ours", and a lookup that found only others' objects
is a not-found. So the not-found rules (workers/reconcile/judge.py) weigh it: authoritative only as
declared, and never where the provider does not honour our key (no ``provider_idempotency``): there
a re-send after a miss could be a second effect, so the lookup is repeated and then a person decides.
Where the provider honours the key, a re-send under the same key is deduplicated, and the declared
``authoritative_not_found`` holds.

How to call it (pure, no I/O)::

    from outbox.actions.matching import mismatches, MissingArgument

    try:
        wrong = mismatches(found_object, spec.match, args, idempotency_key=key)
    except MissingArgument:
        ...  # the intent lacks a compared argument (purged?): nothing can be verified
    ours = not wrong  # every declared field equal

``Mismatch`` carries the path and both values; ``describe()`` names the paths only (values can be
personal data: say them where the reader may see them).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Compare = Literal["exact", "casefold"]
# A decimal as people write money: an optional minus, no leading zeros (an id "007" is text), an
# optional fraction. No exponent, no spaces, no plus sign: those are text as the provider wrote them.
_PLAIN_DECIMAL = re.compile(r"^-?(0|[1-9]\d*)(\.\d+)?$")
# The key the provider sees may be compared too (a provider that keeps it in metadata).
KEY_PLACEHOLDER = "idempotency_key"


class MatchRule(BaseModel):
    """The long form of one ``match:`` entry: the template, and how to compare."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    equals: str
    compare: Compare = "exact"


# What ``lookup.match`` holds: a dotted path of the found object -> a template, or the long form.
Match = dict[str, str | MatchRule]


@dataclass(frozen=True)
class Mismatch:
    """One declared field whose value in the found object is not the intent's."""

    path: str
    found: Any  # MISSING when the object has no such field
    wanted: Any

    def describe(self) -> str:
        return f"{self.path} absent" if self.found is MISSING else f"{self.path} differs"


class MissingArgument(ValueError):
    """A compared argument is not in the intent (never given, or purged): nothing can be verified."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(f"the intent has no argument(s) {sorted(names)} to compare the found object with")
        self.names = names


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


def rule_of(entry: str | MatchRule) -> MatchRule:
    return entry if isinstance(entry, MatchRule) else MatchRule(equals=entry)


def placeholders(template: str) -> set[str]:
    """The ``{name}`` placeholders of a template (a path, a query value, a match template); ValueError
    if one is not a plain argument name. The one parser of templates (outbox/actions/specs.py too)."""
    names: set[str] = set()
    for _, field, spec, conv in string.Formatter().parse(template):
        if field is None:
            continue
        if not field.isidentifier() or spec or conv:
            raise ValueError(f"placeholder {{{field}}} must be a plain argument name")
        names.add(field)
    return names


def match_arguments(match: Match) -> set[str]:
    """Every argument name the templates compare (``idempotency_key`` included when used)."""
    names: set[str] = set()
    for entry in match.values():
        names |= placeholders(rule_of(entry).equals)
    return names


def match_problem(match: Match) -> str | None:
    """Why ``match`` cannot be used (None: it can): a bad path, a bad template, or no argument at all."""
    for path, entry in match.items():
        if not path or any(not part for part in path.split(".")):
            return f"{path!r} is not a dotted path of the found object (e.g. amount, refund.amount)"
        try:
            placeholders(rule_of(entry).equals)
        except ValueError as exc:
            return f"{path}: {exc}"
    if not match_arguments(match):
        return (
            "compares no argument of the intent: a field equal to a constant cannot tell our object from "
            'another one; name an argument, e.g. amount: "{amount}"'
        )
    return None


def dig(obj: Any, path: str) -> Any:
    """``obj["a"]["b"]`` for ``"a.b"`` (a number steps into a list); MISSING when a step is absent."""
    for part in path.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return MISSING
    return obj


def render(template: str, values: Mapping[str, Any]) -> Any:
    """The intent's value for a template: the argument itself for ``"{name}"``, text otherwise."""
    names = placeholders(template)
    absent = {n for n in names if n not in values}
    if absent:
        raise MissingArgument(absent)
    if len(names) == 1 and template == "{" + next(iter(names)) + "}":
        return values[next(iter(names))]
    return template.format_map({n: _text(values[n]) for n in names})


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    return str(value)


def _decimal(value: Any) -> Decimal | None:
    """The value as a decimal when it is one (a JSON number, or a plainly written decimal string)."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, Decimal):
            return value if value.is_finite() else None
        if isinstance(value, int):
            return Decimal(value)
        if isinstance(value, float):
            number = Decimal(repr(value))
            return number if number.is_finite() else None
        if isinstance(value, str) and _PLAIN_DECIMAL.match(value):
            return Decimal(value)
    except (InvalidOperation, ValueError):
        return None
    return None


def same(found: Any, wanted: Any, compare: Compare = "exact") -> bool:
    """Whether a found value equals the intent's (module docstring: decimals as decimals)."""
    if found is MISSING:
        return False
    a, b = _decimal(found), _decimal(wanted)
    if a is not None and b is not None:
        return a == b
    if isinstance(found, str) and isinstance(wanted, str):
        return found.casefold() == wanted.casefold() if compare == "casefold" else found == wanted
    if isinstance(found, dict) and isinstance(wanted, dict):
        return found.keys() == wanted.keys() and all(same(found[k], wanted[k], compare) for k in found)
    if isinstance(found, list) and isinstance(wanted, list):
        return len(found) == len(wanted) and all(same(x, y, compare) for x, y in zip(found, wanted))
    # bool, None, and values of different kinds: equal only as the same kind (true is not 1).
    return type(found) is type(wanted) and found == wanted


def mismatches(
    found: Any, match: Match, args: Mapping[str, Any], *, idempotency_key: str | None = None
) -> list[Mismatch]:
    """The declared fields of ``found`` that are not the intent's (empty: it is ours as far as
    ``match`` can tell). Raises MissingArgument when the intent lacks a compared argument."""
    values: dict[str, Any] = dict(args)
    if idempotency_key is not None:
        values[KEY_PLACEHOLDER] = idempotency_key
    out: list[Mismatch] = []
    for path, entry in match.items():
        rule = rule_of(entry)
        wanted = render(rule.equals, values)
        value = dig(found, path)
        if not same(value, wanted, rule.compare):
            out.append(Mismatch(path, value, wanted))
    return out


def describe(wrong: list[Mismatch]) -> str:
    """The mismatched paths, for a reason a person reads (no values: they can be personal data)."""
    return ", ".join(m.describe() for m in wrong)
