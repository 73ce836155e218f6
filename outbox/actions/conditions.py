"""A small, safe expression over an intent's arguments: ``amount > 500``,
``currency == 'EUR' and amount >= 100``, ``customer.tier in ['gold', 'vip']``.

Parsed with Python's ``ast`` and evaluated by walking an allow-list of nodes: comparisons, ``and``,
``or``, ``not``, names and dotted names (argument paths), numbers, strings, booleans, None and
lists of them. No calls, no subscripts, no attribute of anything but an argument path: nothing of
Python is reachable. Numbers compare as exact decimals. A missing argument is None; comparing
None or mismatched types with ``<`` is False, never an error (the rule then does not apply). A
decimal string beside a number compares as that number (money is sent as "900.00").
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


class ConditionError(ValueError):
    """The expression is not one this evaluator accepts."""


def parse_condition(text: str) -> ast.expr:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ConditionError(f"{text!r} is not an expression: {exc.msg}") from None
    _check(tree.body, text)
    return tree.body


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        _check(node.operand, text)
    elif isinstance(node, ast.Compare):
        if not all(type(op) in _COMPARE for op in node.ops):
            raise ConditionError(f"{text!r}: only ==, !=, <, <=, >, >=, in, not in compare")
        for v in (node.left, *node.comparators):
            _check(v, text)
    elif isinstance(node, ast.Name) or isinstance(node, ast.Attribute) and _path(node) is not None:
        if any(part.startswith("_") for part in (_path(node) or "").split(".")):
            raise ConditionError(f"{text!r}: names starting with _ are not argument names")
        return
    elif isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        return
    elif isinstance(node, (ast.List, ast.Tuple)):
        for v in node.elts:
            _check(v, text)
    else:
        raise ConditionError(
            f"{text!r}: {type(node).__name__} is not allowed (use argument names, numbers, strings, "
            "comparisons, and/or/not)"
        )


def _path(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _path(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def evaluate(node: ast.expr, args: dict[str, Any]) -> bool:
    return bool(_eval(node, args))


def _number(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    return value


def _comparable(a: Any, b: Any) -> tuple[Any, Any]:
    """Money travels as decimal strings ("900.00"): beside a number, such a string is that number."""
    if isinstance(a, Decimal) and isinstance(b, str):
        return a, _decimal_or(b)
    if isinstance(b, Decimal) and isinstance(a, str):
        return _decimal_or(a), b
    return a, b


def _decimal_or(text: str) -> Any:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        return text
    return value if value.is_finite() else text


def _eval(node: ast.AST, args: dict[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, args) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.UnaryOp):
        return not _eval(node.operand, args)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, args)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _eval(right_node, args)
            try:
                a, b = _comparable(left, right)
                if not _COMPARE[type(op)](a, b):
                    return False
            except (TypeError, InvalidOperation):
                return False
            left = right
        return True
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(v, args) for v in node.elts]
    path = _path(node)
    value: Any = args
    for part in (path or "").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return _number(value)
