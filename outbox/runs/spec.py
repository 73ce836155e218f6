"""A run's specification: its ordered steps, their derived keys, and the digest that makes a
resubmission the same run or a conflict (DESIGN.md, "Runs").

A step's idempotency key is derived from the run key and the step name, never from a retry:
``{run_key}:{step}``, and its compensation's ``{run_key}:{step}:compensate``. Step names therefore
hold no ``:`` and are not ``compensate``, so no two keys of one tenant's runs can coincide.

What the actions file says of a step's action at submit (``phase``, ``irreversible``) is kept with
the run, as a provider key is: editing the file does not change a run already accepted (the advance
also reads the file where it has one, and the stricter of the two wins).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal, Protocol

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import build_envelope, canonical_value, digest_of, dumps_canonical, loads_exact
from outbox.ledger.intent import MAX_KEY_LEN, MAX_SECONDS, require_storable
from outbox.ledger.provider_keys import SubmitRules, rule_for

MAX_STEPS = 50
MAX_RUN_ATTEMPTS = 10_000
COMPENSATE = "compensate"
Phase = Literal["draft", "commit"]


class StepRules(SubmitRules, Protocol):
    """What a producer knows of each action (outbox.actions.rules.ActionRules)."""

    def phase_of(self, action: str) -> Phase | None: ...

    def is_irreversible(self, action: str) -> bool: ...


@dataclass(frozen=True)
class Compensation:
    action: str
    args: str | None  # canonical JSON text, as an operation stores it (None once purged)
    args_digest: str
    provider_key: str | None = None
    requires_approval: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "args": self.args,
            "args_digest": self.args_digest,
            "provider_key": self.provider_key,
            "requires_approval": self.requires_approval,
        }


@dataclass(frozen=True)
class Step:
    name: str
    action: str
    args: str | None  # canonical JSON text (None once purged: outbox/privacy/retention.py)
    args_digest: str
    compensate: Compensation | None = None
    phase: Phase | None = None
    irreversible: bool = False
    # Decided at submit, as for a single intent: the key the provider sees, and whether a person
    # must approve the step before it is sent (the send checks approval again).
    provider_key: str | None = None
    requires_approval: bool = False

    def key(self, run_key: str) -> str:
        return f"{run_key}:{self.name}"

    def compensation_key(self, run_key: str) -> str:
        return f"{run_key}:{self.name}:{COMPENSATE}"

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "action": self.action,
            "args": self.args,
            "args_digest": self.args_digest,
            "compensate": None if self.compensate is None else self.compensate.as_json(),
            "phase": self.phase,
            "irreversible": self.irreversible,
            "provider_key": self.provider_key,
            "requires_approval": self.requires_approval,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        comp = data.get("compensate")
        return cls(
            name=data["name"],
            action=data["action"],
            args=data["args"],
            args_digest=data["args_digest"],
            compensate=None if comp is None else Compensation(**comp),
            phase=data.get("phase"),
            irreversible=bool(data.get("irreversible")),
            provider_key=data.get("provider_key"),
            requires_approval=bool(data.get("requires_approval")),
        )


@dataclass(frozen=True)
class Budget:
    """A task-level budget every step draws from (None: unlimited, each action's own budget)."""

    max_attempts: int | None = None
    deadline_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "deadline_s": self.deadline_s}


@dataclass(frozen=True)
class RunSpec:
    tenant: str
    run_key: str
    subject: str
    steps: tuple[Step, ...]
    budget: Budget

    @property
    def digest(self) -> str:
        """Same run key + same digest = the same run; anything else is a conflict. The digest
        covers what each step will do (names, actions, args, compensations) and the budget."""
        parts = [
            [
                s.name,
                s.action,
                s.args_digest,
                None if s.compensate is None else [s.compensate.action, s.compensate.args_digest],
            ]
            for s in self.steps
        ]
        return digest_of(dumps_canonical({"steps": parts, "budget": canonical_value(self._budget_for_digest())}))

    def _budget_for_digest(self) -> dict[str, Any]:
        # Decimal-exact, so 60 and 60.0 are one budget.
        deadline = None if self.budget.deadline_s is None else Decimal(str(self.budget.deadline_s))
        return {"max_attempts": self.budget.max_attempts, "deadline_s": deadline}

    def steps_json(self) -> str:
        return json.dumps([s.as_json() for s in self.steps], ensure_ascii=False, separators=(",", ":"))


def steps_from_json(text: str) -> tuple[Step, ...]:
    return tuple(Step.from_json(item) for item in json.loads(text))


def _require_text(field: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidIntent(field, "required: a non-empty string")
    if value != value.strip() or len(value) > max_len:
        raise InvalidIntent(field, f"must be 1-{max_len} characters without surrounding whitespace")
    require_storable(field, value)
    return value


def _budget(raw: Any) -> Budget:
    if raw is None:
        return Budget()
    if not isinstance(raw, Mapping):
        raise InvalidIntent("budget", "must be an object {max_attempts, deadline_s}")
    unknown = set(raw) - {"max_attempts", "deadline_s"}
    if unknown:
        raise InvalidIntent(f"budget.{sorted(unknown)[0]}", "unknown field; a budget has max_attempts and deadline_s")
    attempts, deadline = raw.get("max_attempts"), raw.get("deadline_s")
    if attempts is not None and (
        not isinstance(attempts, int) or isinstance(attempts, bool) or not 1 <= attempts <= MAX_RUN_ATTEMPTS
    ):
        raise InvalidIntent(
            "budget.max_attempts", f"must be an integer from 1 to {MAX_RUN_ATTEMPTS} (attempts across all steps)"
        )
    if deadline is not None:
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float, Decimal)):
            raise InvalidIntent("budget.deadline_s", "must be a number of seconds")
        if not 0 < deadline <= MAX_SECONDS:
            raise InvalidIntent("budget.deadline_s", f"must be a positive number of seconds up to {MAX_SECONDS:.0f}")
        deadline = float(deadline)
    return Budget(attempts, deadline)


def _args(field: str, tenant: str, action: Any, args: Any, subject: str) -> tuple[str, str, str]:
    try:
        env = build_envelope(tenant=tenant, action=action, args=args, subject=subject)
    except InvalidIntent as exc:
        raise InvalidIntent(f"{field}.{exc.field}", exc.reason) from None
    return env.action, env.canonical_args, env.digest


def build_run_spec(
    *,
    tenant: Any,
    run_key: Any,
    steps: Any,
    subject: Any,
    budget: Any = None,
    rules: StepRules | None = None,
) -> RunSpec:
    """Validate a run as submitted; raises InvalidIntent naming the field (``steps[2].name``)."""
    tenant = _require_text("tenant", tenant, 128)
    subject = _require_text("subject", subject, 255)
    run_key = _require_text("run_key", run_key, MAX_KEY_LEN)
    if not isinstance(steps, (list, tuple)) or not steps:
        raise InvalidIntent("steps", "required: a non-empty list of {name, action, args, compensate?}")
    if len(steps) > MAX_STEPS:
        raise InvalidIntent("steps", f"at most {MAX_STEPS} steps in one run")
    out: list[Step] = []
    seen: set[str] = set()
    for i, raw in enumerate(steps):
        where = f"steps[{i}]"
        if not isinstance(raw, Mapping):
            raise InvalidIntent(where, "must be an object {name, action, args, compensate?}")
        unknown = set(raw) - {"name", "action", "args", "compensate"}
        if unknown:
            raise InvalidIntent(
                f"{where}.{sorted(unknown)[0]}", "unknown field; a step has name, action, args, compensate"
            )
        name = _require_text(f"{where}.name", raw.get("name"), 64)
        if ":" in name or name == COMPENSATE:
            raise InvalidIntent(
                f"{where}.name", f"must not contain ':' nor be {COMPENSATE!r} (it is part of derived keys)"
            )
        if name in seen:
            raise InvalidIntent(f"{where}.name", f"{name!r} is used by an earlier step; step names are unique in a run")
        seen.add(name)
        if len(f"{run_key}:{name}:{COMPENSATE}") > MAX_KEY_LEN:
            raise InvalidIntent(
                f"{where}.name",
                f"run_key + ':' + name + ':compensate' must fit {MAX_KEY_LEN} characters (a derived key)",
            )
        action, args, digest = _args(where, tenant, raw.get("action"), raw.get("args", {}), subject)
        comp = None
        if raw.get("compensate") is not None:
            c = raw["compensate"]
            if not isinstance(c, Mapping) or set(c) - {"action", "args"}:
                raise InvalidIntent(f"{where}.compensate", "must be an object {action, args}")
            c_action, c_args, c_digest = _args(
                f"{where}.compensate", tenant, c.get("action"), c.get("args", {}), subject
            )
            c_key = f"{run_key}:{name}:{COMPENSATE}"
            comp = Compensation(
                c_action,
                c_args,
                c_digest,
                rule_for(rules, c_action).render(tenant=tenant, idempotency_key=c_key, action=c_action),
                rules is not None and rules.needs_approval(c_action, loads_exact(c_args)),
            )
        phase = rules.phase_of(action) if rules is not None else None
        irreversible = rules.is_irreversible(action) if rules is not None else False
        key = f"{run_key}:{name}"
        provider_key = rule_for(rules, action).render(tenant=tenant, idempotency_key=key, action=action)
        approval = rules is not None and rules.needs_approval(action, loads_exact(args))
        if irreversible and comp is not None:
            raise InvalidIntent(
                f"{where}.compensate", f"{action} is irreversible in the actions file: it cannot be compensated"
            )
        out.append(Step(name, action, args, digest, comp, phase, irreversible, provider_key, approval))
    commits = [i for i, s in enumerate(out) if s.phase == "commit"]
    if len(commits) > 1:
        raise InvalidIntent(f"steps[{commits[1]}].action", "a run has at most one commit step (phase: commit)")
    if commits and commits[0] != len(out) - 1:
        raise InvalidIntent(
            f"steps[{commits[0]}].action",
            "the commit step (phase: commit) must be the run's last step: it makes the drafts real",
        )
    return RunSpec(tenant, run_key, subject, tuple(out), _budget(budget))
