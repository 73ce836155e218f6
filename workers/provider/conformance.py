"""The probe's conformance report: one row per declaration checked (workers/provider/probe.py),
as a table for people and a stable JSON document for scripts."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

KEY_PREFIX = "probe-"


def probe_key() -> str:
    """A fresh key, marked as the probe's."""
    return KEY_PREFIX + secrets.token_hex(8)


@dataclass(frozen=True)
class Check:
    name: str
    declared: str
    observed: str
    ok: bool | None  # None: not checked
    fix: str | None = None  # the actions-file setting to change, when broken

    @property
    def verdict(self) -> str:
        return "not checked" if self.ok is None else ("ok" if self.ok else "BROKEN")

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "declared": self.declared,
            "observed": self.observed,
            "ok": self.ok,
            "verdict": self.verdict,
            "fix": self.fix,
        }


@dataclass
class ProbeReport:
    action: str
    target: str
    checks: list[Check] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # every key the probe sent or looked up
    effects: list[str] = field(default_factory=list)  # provider references of the objects it created

    @property
    def ok(self) -> bool:
        return all(check.ok is not False for check in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "target": self.target,
            "ok": self.ok,
            "checks": [c.as_json() for c in self.checks],
            "keys": list(self.keys),
            "effects": list(self.effects),
        }
