"""The provider contract, checked: does a provider do what an action's declarations say it does?

Every guarantee of the outbox rests on a few declarations in the actions file: the provider honours
idempotency keys (``provider_idempotency``), refuses other arguments under a used key, a lookup finds
an effect once ``lookup.settle_s`` has passed, "not found" means never executed
(``lookup.authoritative_not_found``), and an older fencing token is refused after a newer one
(``provider_fencing``). ``agent-outbox probe ACTION`` sends real requests, through the connector the
workers use, to a provider's test mode and reports what it observed against each declaration, with
the setting to change when they disagree.

It makes effects: one object under a fresh probe key (``probe-<random>``), a second only where the
provider breaks a declaration (that is the finding). A target must say it is a test mode
(``test_mode: true``) or the caller must pass ``allow_live``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from outbox.errors import ConfigError
from outbox.ledger.states import AttemptClass
from workers.provider.actions import ActionConfig, ActionsConfig
from workers.provider.connectors import AttemptResult, HttpConnector
from workers.provider.lookups import LookupResult

# How long the probe waits for a lookup to find what it created: past the declared settle window,
# up to this much, to say by how much the declaration is short.
MAX_LAG_WAIT_S = 30.0
POLL_S = 0.2


class ProbeRefused(ConfigError):
    """The probe will not run (a live target, an action without what it needs)."""


@dataclass(frozen=True)
class Check:
    name: str
    declared: str
    observed: str
    ok: bool | None  # None: not checked (nothing declared to check, or the provider cannot say)
    fix: str = ""


@dataclass
class ProbeReport:
    action: str
    target: str
    probe_key: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "target": self.target,
            "probe_key": self.probe_key,
            "ok": self.ok,
            "checks": [asdict(c) for c in self.checks],
        }


def _changed(args: dict[str, Any], action: ActionConfig) -> dict[str, Any]:
    """The same call with one argument changed: a decimal argument plus one cent, else the first
    text argument with a suffix."""
    for name in action.decimal_args:
        if name in args:
            return args | {name: str(Decimal(str(args[name])) + Decimal("0.01"))}
    for name, value in args.items():
        if isinstance(value, str):
            return args | {name: value + "-probe"}
    raise ProbeRefused("the probe needs a decimal or text argument to change (--args)")


def _said(result: AttemptResult) -> str:
    c = result.classification
    ref = f", reference {c.provider_reference}" if c.provider_reference else ""
    return f"HTTP {result.status_code} ({c.klass.value}{ref})" if result.status_code else f"no answer ({c.reason})"


def _refused(result: AttemptResult) -> bool:
    return result.status_code in (409, 422) or result.classification.klass is AttemptClass.REJECTED


class Probe:
    def __init__(
        self,
        actions: ActionsConfig,
        action_name: str,
        args: dict[str, Any],
        *,
        tenant: str = "probe",
        allow_live: bool = False,
        connector: HttpConnector | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if action_name not in actions.actions:
            known = ", ".join(sorted(actions.actions)) or "(none)"
            raise ProbeRefused(f"unknown action {action_name!r}; known: {known}")
        self.name, self.action = action_name, actions.actions[action_name]
        target = actions.targets[self.action.target]
        if not target.test_mode and not allow_live:
            raise ProbeRefused(
                f"target {self.action.target!r} is not declared a test mode: the probe makes real effects. "
                f"Point it at the provider's test mode and set targets.{self.action.target}.test_mode: true, "
                "or pass --allow-live"
            )
        self.args, self.tenant = args, tenant
        self.connector = connector or HttpConnector(actions)
        self.clock, self.sleep = clock, sleep
        self.key = f"probe-{uuid.uuid4().hex[:16]}"
        self.report = ProbeReport(action_name, self.action.target, self.key)

    def _send(self, args: dict[str, Any], key: str, token: int) -> AttemptResult:
        return self.connector.send(
            self.name, self.action, args=args, idempotency_key=key, fencing_token=token, tenant=self.tenant
        )

    def _lookup(self, key: str, token: int | None = None) -> LookupResult:
        return self.connector.lookup(
            self.name, self.action, args=self.args, idempotency_key=key, fencing_token=token, tenant=self.tenant
        )

    def run(self) -> ProbeReport:
        checks = self.report.checks
        first = self._send(self.args, self.key, 1)
        if first.classification.klass is not AttemptClass.SUCCEEDED:
            checks.append(
                Check(
                    "first call succeeds",
                    "a valid call with --args",
                    _said(first) + (f": {first.raw_error[:200]}" if first.raw_error else ""),
                    False,
                    "the probe needs a call the provider accepts: check --args, the target's base_url and credentials",
                )
            )
            return self.report
        reference = first.classification.provider_reference
        checks.append(self._replay(reference))
        checks.append(self._changed_args())
        checks.append(self._lookup_finds(reference))
        checks.append(self._not_found())
        checks.append(self._fencing())
        checks.append(
            Check(
                "key retention",
                f"{self.action.provider_idempotency.retention_s:g} s" if self.action.provider_idempotency else "-",
                "the provider exposes no key retention to read",
                None,
            )
        )
        return self.report

    def _replay(self, reference: str | None) -> Check:
        declared = self.action.provider_idempotency
        if declared is None:
            return Check(
                "same key replays", "no provider_idempotency", "not checked: nothing is re-sent without proof", None
            )
        again = self._send(self.args, self.key, 2)
        same = (
            again.classification.klass is AttemptClass.SUCCEEDED
            and again.classification.provider_reference == reference
        )
        observed = f"first {reference}, again {_said(again)}"
        return Check(
            "same key replays the same result",
            f"provider_idempotency.header {declared.header}",
            observed,
            same,
            ""
            if same
            else f"the provider made or answered something else for a used key: remove actions.{self.name}."
            "provider_idempotency (the outbox then never re-sends without a lookup's proof), or fix the header name",
        )

    def _changed_args(self) -> Check:
        if self.action.provider_idempotency is None:
            return Check("changed arguments refused", "no provider_idempotency", "not checked", None)
        other = self._send(_changed(self.args, self.action), self.key, 3)
        refused = _refused(other)
        return Check(
            "changed arguments under a used key are refused",
            "409 or 422",
            _said(other),
            refused,
            ""
            if refused
            else "the provider accepts other arguments under a used key: the outbox refuses them at submit itself "
            "(409), but another client's call with this key would not be: give this provider keys no other client "
            f"uses (actions.{self.name}.provider_key)",
        )

    def _lookup_finds(self, reference: str | None) -> Check:
        spec = self.action.lookup
        if spec is None:
            return Check("lookup finds the effect", "no lookup", "not checked: unknowns go to a person", None)
        started = self.clock()
        deadline = started + max(spec.settle_s * 2, spec.settle_s + MAX_LAG_WAIT_S)
        found = self._lookup(self.key)
        while found.outcome != "found" and self.clock() < deadline:
            self.sleep(POLL_S)
            found = self._lookup(self.key)
        lag = self.clock() - started
        if found.outcome != "found":
            return Check(
                "lookup finds the effect",
                f"within settle_s {spec.settle_s:g} s",
                f"not found after {lag:.1f} s ({found.reason})",
                False,
                f"check actions.{self.name}.lookup (request, key_field, items_field) against the provider's answer",
            )
        right = reference is None or found.provider_reference in (None, reference)
        in_time = lag <= spec.settle_s
        fix = ""
        if not right:
            fix = f"the lookup found {found.provider_reference}, the call made {reference}: check lookup.key_field"
        elif not in_time:
            fix = f"raise actions.{self.name}.lookup.settle_s to at least {lag * 1.5:.0f} (it took {lag:.1f} s)"
        return Check(
            "lookup finds the effect",
            f"within settle_s {spec.settle_s:g} s",
            f"found {found.provider_reference or ''} after {lag:.1f} s ({found.state})".replace("  ", " "),
            right and in_time,
            fix,
        )

    def _not_found(self) -> Check:
        spec = self.action.lookup
        if spec is None:
            return Check("not found is authoritative", "no lookup", "not checked", None)
        never = f"probe-never-{uuid.uuid4().hex[:12]}"
        answers = [self._lookup(never) for _ in range(2)]
        outcomes = [a.outcome for a in answers]
        if not spec.authoritative_not_found:
            return Check("not found is authoritative", "authoritative_not_found: false", ", ".join(outcomes), None)
        ok = outcomes == ["not_found", "not_found"]
        return Check(
            "not found is authoritative",
            "authoritative_not_found: true",
            f"a key never used: {', '.join(outcomes)}",
            ok,
            ""
            if ok
            else f"the provider does not answer 'not found' for a key it never saw: set actions.{self.name}.lookup."
            "authoritative_not_found: false (a person decides instead of a re-send)",
        )

    def _fencing(self) -> Check:
        if not self.action.provider_fencing:
            return Check("older fencing token refused", "provider_fencing: false", "not checked", None)
        if self.action.lookup is None:
            return Check("older fencing token refused", "provider_fencing: true", "not checked: no lookup", None)
        key = f"probe-fence-{uuid.uuid4().hex[:12]}"
        self._lookup(key, token=10)  # a lookup carrying a newer token, as the reconciler's does
        late = self._send(self.args, key, 5)  # then an older attempt arrives
        refused = late.classification.klass is not AttemptClass.SUCCEEDED
        return Check(
            "older fencing token refused",
            f"provider_fencing: true ({self.action.fencing_header})",
            f"token 5 after a lookup with 10: {_said(late)}",
            refused,
            ""
            if refused
            else f"the provider took an older token after a newer one: set actions.{self.name}.provider_fencing: "
            "false (a 'not found' then proves nothing while an attempt may still land)",
        )
