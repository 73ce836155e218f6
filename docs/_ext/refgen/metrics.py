"""Every Prometheus metric the code defines, read from the source of the modules that use
prometheus_client: the process metrics (Counter, Gauge, Histogram) and the collectors' families read at
scrape time (GaugeMetricFamily, HistogramMetricFamily, and the report's figures)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from refgen.markdown import GENERATED, code, table

PACKAGES = ("outbox", "producer", "workers", "breaker")
KINDS = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    "CounterMetricFamily": "counter",
}


def _text(node: ast.AST | None) -> str | None:
    """A string literal, an implicit concatenation, or an f-string with its fields shown as <...>."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append("<" + ast.unparse(value.value).removeprefix("self.") + ">")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return left + right if left is not None and right is not None else None
    return None


def _labels(call: ast.Call) -> list[str]:
    node = call.args[2] if len(call.args) > 2 else None
    for kw in call.keywords:
        if kw.arg in ("labels", "labelnames"):
            node = kw.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [str(e.value) for e in node.elts if isinstance(e, ast.Constant)]
    return []


def _metrics(path: Path, root: Path) -> Iterator[tuple[str, str, str, list[str], str]]:
    tree = ast.parse(path.read_text())
    where = str(path.relative_to(root))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in KINDS and len(node.args) >= 2:
                name, doc = _text(node.args[0]), _text(node.args[1])
                if name and name.startswith("outbox_") and doc is not None:
                    kind = KINDS[func]
                    shown = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
                    yield shown, kind, doc, _labels(node), where
        # The report's figures: ("outbox_...", value, "help") tuples made into gauges in a loop.
        if isinstance(node, ast.Tuple) and len(node.elts) == 3:
            name, doc = _text(node.elts[0]), _text(node.elts[2])
            if name and name.startswith("outbox_") and doc:
                yield name, "gauge", doc, [], where


def render(root: Path) -> str:
    found: dict[str, tuple[str, str, str, list[str], str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "prometheus_client" in path.read_text():
                for metric in _metrics(path, root):
                    found.setdefault(metric[0], metric)
    rows = [
        (code(name), kind, ", ".join(labels), doc, code(where))
        for name, kind, doc, labels, where in sorted(found.values())
    ]
    return "\n".join(
        [GENERATED.format(name="metrics"), "", *table(("metric", "type", "labels", "meaning", "defined in"), rows)]
    )
