"""The provider-contract probe: does the provider do what the actions file declares it does?

Every guarantee rests on a few declarations of an action (DESIGN.md, "Configuration"): the provider
deduplicates by our key (``provider_idempotency``), refuses changed arguments under a key, a lookup
finds an effect within ``lookup.settle_s``, its "not found" is the truth
(``lookup.authoritative_not_found``), it refuses older fencing tokens (``provider_fencing``), and it
keeps keys for ``provider_idempotency.retention_s``. The probe checks each against the provider's
test mode, through the connector the workers use (the same requests, headers and classification),
and names the setting to change when a declaration does not hold.

It makes real requests, so it runs only against a target declared ``test_mode: true``; its keys
start with ``probe-``. The effects it makes are listed in the report (one when the provider is
healthy: the replayed create).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from outbox.errors import ConfigError, OutboxError
from outbox.ledger.states import AttemptClass
from workers.provider.actions import ActionConfig, ActionsFile
from workers.provider.conformance import Check, ProbeReport, probe_key
from workers.provider.connectors import AttemptResult, Connector, ConnectorSet
from workers.provider.lookups import LookupResult, verify_found
from workers.provider.probe_args import CHANGED_SUFFIX as CHANGED_SUFFIX
from workers.provider.probe_args import changed_args, other_intent

REFUSED_STATUSES = frozenset({409, 422})
MANY_EFFECTS_FIX = "provider_idempotency: the provider made several effects under one key (see the first check)"


class NotATestMode(ConfigError):
    """The probe was asked to run against a target not declared a test mode."""

    def __init__(self, target: str) -> None:
        super().__init__(
            f"target {target!r} is not declared a test mode: the probe makes real requests and effects; "
            f"add `test_mode: true` under targets.{target} in an actions file that points at the "
            "provider's test mode (sandbox, test API keys), never at production"
        )
        self.target = target


class ProbeAborted(OutboxError):
    """The provider's answers left the probe nothing to conclude (its create failed: down, a 5xx, a
    lost answer)."""


class ProbeArgsRefused(ConfigError):
    """The provider (or the request builder) refused the probe's create: its arguments are wrong."""


def _unclear(result: AttemptResult) -> bool:
    """No answer that says anything about the declaration: no response, a 5xx, a 429."""
    return result.status_code is None or result.status_code >= 500 or result.status_code == 429


def _inconclusive(name: str, declared: str, observed: str) -> Check:
    return Check(name, declared, f"inconclusive: {observed} (the provider did not answer clearly; probe again)", None)


def _answer(result: AttemptResult) -> str:
    c = result.classification
    if c.klass is AttemptClass.SUCCEEDED:
        return f"{result.status_code} {c.provider_reference or '(no reference)'}"
    return f"{result.status_code or c.reason} {c.klass.value}"


class Probe:
    """One run of the checks against one action; see ``run_probe``."""

    def __init__(
        self,
        config: ActionsFile,
        action: str,
        args: dict[str, Any],
        *,
        connector: Connector,
        tenant: str = "",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.1,
        find_within_s: float | None = None,
    ) -> None:
        self.config, self.name, self.args = config, action, args
        self.cfg = config.action(action)
        self.connector, self.tenant = connector, tenant
        self._sleep, self._clock, self.poll_s = sleep, clock, poll_s
        settle_s = self.cfg.lookup.settle_s if self.cfg.lookup else 0.0
        # How long a lookup is given to find the created effect: well past the declared settle window.
        self.find_within_s = find_within_s if find_within_s is not None else max(3 * settle_s, settle_s + 3.0)
        self.report = ProbeReport(action, self.cfg.target)
        self._token = 0
        self.never_found = False  # the lookup never found the probe's own effect
        self.others: dict[str, Any] | None = None  # another intent's arguments (a lookup not by key)

    # --- requests, through the workers' connector --------------------------------------------

    def _next_token(self) -> int:
        self._token += 1
        return self._token

    def _key(self) -> str:
        key = probe_key()
        self.report.keys.append(key)
        return key

    def _send(self, args: dict[str, Any], key: str, token: int | None = None) -> AttemptResult:
        result = self.connector.send(
            self.name,
            self.cfg,
            args=args,
            idempotency_key=key,
            fencing_token=self._next_token() if token is None else token,
            tenant=self.tenant,
        )
        reference = result.classification.provider_reference
        if result.classification.klass is AttemptClass.SUCCEEDED and reference not in self.report.effects:
            self.report.effects.append(reference or f"(unreferenced effect of {key})")
        return result

    def _lookup(self, key: str, token: int | None = None, args: dict[str, Any] | None = None) -> LookupResult:
        args = self.args if args is None else args
        found = self.connector.lookup(
            self.name, self.cfg, args=args, idempotency_key=key, fencing_token=token, tenant=self.tenant
        )
        return verify_found(found, self.cfg.lookup, args, key) if self.cfg.lookup else found

    # --- the checks ---------------------------------------------------------------------------

    def run(self) -> ProbeReport:
        cfg = self.cfg
        unused = self._key()
        # A lookup by a business reference finds the probe's own effect under any key: "not ours" is
        # then an intent whose compared argument differs (self.others), which lookup.match must reject.
        self.others = other_intent(self.args, cfg) if cfg.lookup and not cfg.lookup.by_key else None
        first_unused = self._lookup(unused, args=self.others) if cfg.lookup else None
        unused_at = self._clock()
        key = self._key()
        first = self._send(self.args, key)
        created_at = self._clock()
        klass = first.classification.klass
        if klass is not AttemptClass.SUCCEEDED:
            why = f"the probe's create ({key}) did not succeed: {_answer(first)}: {first.raw_error or ''}".strip()
            if klass in (AttemptClass.NOT_SENT, AttemptClass.REJECTED):
                raise ProbeArgsRefused(why + "; give arguments the provider accepts (--args)")
            raise ProbeAborted(why + "; nothing to conclude, try again when the provider answers")
        self.report.checks.append(self._replay(key, first))
        self.report.checks.append(self._changed_args(key, first))
        found = self._finds(key, first, created_at)
        self.report.checks.append(found)
        self.report.checks.append(self._not_found(unused, first_unused, unused_at))
        self.report.checks.append(self._fencing())
        self.report.checks.append(self._retention())
        return self.report

    def _replay(self, key: str, first: AttemptResult) -> Check:
        keys = self.cfg.provider_idempotency
        name = "same key replays the same result"
        if keys is None:
            return Check(name, "provider_idempotency: none", "not checked: no key is sent to the provider", None)
        declared = f"provider_idempotency.header: {keys.header}"
        second = self._send(self.args, key)
        ref1, ref2 = first.classification.provider_reference, second.classification.provider_reference
        observed = f"two calls with {key}: {_answer(first)}; {_answer(second)}"
        if _unclear(second):
            return _inconclusive(name, declared, observed)
        if second.classification.klass is AttemptClass.SUCCEEDED and ref1 is not None and ref1 == ref2:
            return Check(name, declared, observed + " (one effect)", True)
        if second.classification.klass is AttemptClass.SUCCEEDED:
            observed += " (two effects)"
        return Check(
            name,
            declared,
            observed,
            False,
            f"provider_idempotency: the provider does not deduplicate by {keys.header}: set "
            "provider_idempotency.header to the header it reads, or remove provider_idempotency "
            "(and keep on_ambiguous: lookup)",
        )

    def _changed_args(self, key: str, first: AttemptResult) -> Check:
        keys = self.cfg.provider_idempotency
        name = "changed arguments under one key are refused"
        if keys is None:
            return Check(name, "provider_idempotency: none", "not checked: no key is sent to the provider", None)
        changed = changed_args(self.args, self.cfg)
        declared = "provider_idempotency (409/422 on reuse)"
        if changed is None:
            return Check(name, declared, "not checked: no body argument to change (--args)", None)
        args, arg = changed
        result = self._send(args, key)
        observed = f"{arg} changed under {key}: {_answer(result)}"
        if _unclear(result):
            return _inconclusive(name, declared, observed)
        if result.classification.klass is not AttemptClass.SUCCEEDED and result.status_code in REFUSED_STATUSES:
            return Check(name, declared, observed, True)
        if result.classification.klass is AttemptClass.SUCCEEDED:
            same = result.classification.provider_reference == first.classification.provider_reference
            observed += " (accepted: replayed the first answer)" if same else " (accepted: a new effect)"
        return Check(
            name,
            declared,
            observed,
            False,
            "provider_idempotency: the provider accepts other arguments under a used key, so a reused key "
            "silently returns another intent's result: remove provider_idempotency, or keep provider_key "
            "unique per intent (its default {tenant}:{idempotency_key})",
        )

    def _finds(self, key: str, first: AttemptResult, created_at: float) -> Check:
        spec = self.cfg.lookup
        name = "a lookup finds a created effect"
        if spec is None:
            return Check(name, "lookup: none", "not checked: no lookup declared", None)
        declared = f"lookup.settle_s: {spec.settle_s:g}"
        wanted = first.classification.provider_reference
        last: LookupResult | None = None
        while True:
            last = self._lookup(key)
            lag_s = self._clock() - created_at
            if last.outcome == "found":
                break
            if last.outcome == "ambiguous":
                return Check(
                    name,
                    declared,
                    f"{last.reason} (more than one effect under the key, or others' objects the lookup keeps)",
                    False,
                    MANY_EFFECTS_FIX + "; or lookup.key_field / lookup.match, if the lookup returns others' objects",
                )
            if lag_s >= self.find_within_s:
                self.never_found = True
                if last.others:  # it found the probe's effect, and lookup.match called it not ours
                    return Check(
                        name,
                        declared,
                        f"found, but not as this intent's: {last.reason}",
                        False,
                        "lookup.match: the created effect does not match its own intent; compare what the "
                        "provider writes (compare: casefold for a field it changes the case of), and until then "
                        "set lookup.authoritative_not_found: false",
                    )
                return Check(
                    name,
                    declared,
                    f"not found within {lag_s:.1f}s of its creation (last answer: {last.outcome}, {last.reason})",
                    False,
                    "lookup.request: the lookup does not find an effect that exists; fix its path/query "
                    "(or lookup.items / key_field / match), and until then set lookup.authoritative_not_found: false",
                )
            self._sleep(self.poll_s)
        observed = f"found {last.provider_reference} after {lag_s:.2f}s"
        if wanted is not None and last.provider_reference not in (None, wanted):
            if last.provider_reference in self.report.effects:  # another of the probe's own, under this key
                fix = MANY_EFFECTS_FIX
            else:
                fix = (
                    "lookup.key_field / lookup.match: the lookup returns an object that is not this intent's; "
                    "name the field holding the key, or the fields that make an object ours"
                )
            return Check(name, declared, f"found {last.provider_reference}, not the created {wanted}", False, fix)
        if lag_s > spec.settle_s:
            return Check(
                name,
                declared,
                observed + f" (later than settle_s {spec.settle_s:g}s)",
                False,
                f"lookup.settle_s: raise it to at least {math.ceil(lag_s * 1.5)} (the lookup lags {lag_s:.1f}s)",
            )
        return Check(name, declared, observed, True)

    def _not_found(self, key: str, first: LookupResult | None, asked_at: float) -> Check:
        spec = self.cfg.lookup
        name = '"not found" is authoritative'
        if spec is None or first is None:
            return Check(name, "lookup: none", "not checked: no lookup declared", None)
        declared = f"lookup.authoritative_not_found: {str(spec.authoritative_not_found).lower()}"
        if not spec.by_key and self.others is None:
            return Check(name, declared, "not checked: no argument of lookup.match the probe can change", None)
        wait_s = spec.settle_s - (self._clock() - asked_at)
        if wait_s > 0:
            self._sleep(wait_s)
        second = self._lookup(key, args=self.others)
        observed = f"never-used {key}: {first.outcome}, then {second.outcome} after settle_s"
        if self.others is not None:
            differs = sorted(k for k in self.others if self.others[k] != self.args.get(k))
            observed = f"an intent whose {', '.join(differs)} differs: " + observed
        if first.outcome == "found" or second.outcome == "found":
            fix = (
                "lookup.key_field: the lookup finds an object for a key never used (it ignores the key); "
                "name the field holding the key"
                if self.others is None
                else "lookup.match: the lookup adopts the probe's effect for an intent with other arguments; "
                "compare the fields that make an object ours"
            )
            return Check(
                name, declared, observed, False, fix + ", and set lookup.authoritative_not_found: false until it holds"
            )
        if first.outcome != "not_found" or second.outcome != "not_found":
            return Check(
                name,
                declared,
                observed + f" ({first.reason}; {second.reason})",
                False,
                "lookup.request: the lookup does not answer a clear 404 or empty result for an unknown key",
            )
        if spec.authoritative_not_found and self.never_found:
            return Check(
                name,
                declared,
                observed + ", but it also missed an effect that exists",
                False,
                "lookup.authoritative_not_found: false (a 'not found' from this lookup proves nothing)",
            )
        return Check(name, declared, observed, True)

    def _fencing(self) -> Check:
        cfg = self.cfg
        name = "fencing: a newer token refuses an older one"
        if not cfg.provider_fencing:
            return Check(name, "provider_fencing: false", "not checked: provider_fencing not declared", None)
        declared = f"provider_fencing: true ({cfg.fencing_header})"
        if cfg.lookup is None:
            return Check(name, declared, "not checked: no lookup to carry the newer token", None)
        key = self._key()
        older = self._next_token()
        newer = self._next_token()
        looked = self._lookup(key, token=newer)
        result = self._send(self.args, key, token=older)
        observed = (
            f"lookup of {key} with token {newer} ({looked.outcome}), then a create with {older}: {_answer(result)}"
        )
        if _unclear(result):
            return _inconclusive(name, declared, observed)
        if result.classification.klass is not AttemptClass.SUCCEEDED:
            return Check(name, declared, observed + " (refused)", True)
        return Check(
            name,
            declared,
            observed,
            False,
            "provider_fencing: false (the provider does not refuse a token older than one a lookup carried, "
            "so a lookup's 'not found' cannot lock out a request still in flight)",
        )

    def _retention(self) -> Check:
        keys = self.cfg.provider_idempotency
        name = "key retention"
        if keys is None:
            return Check(name, "provider_idempotency: none", "not checked: no key is sent to the provider", None)
        return Check(
            name,
            f"provider_idempotency.retention_s: {keys.retention_s:g}",
            "not checked: the provider does not expose it (take it from the provider's documentation)",
            None,
        )


def missing_args(cfg: ActionConfig, args: dict[str, Any]) -> list[str]:
    """The arguments the action's requests need that ``args`` lacks."""
    needed = cfg.request.placeholder_names() | (cfg.lookup.request.placeholder_names() if cfg.lookup else set())
    return sorted(needed - set(args) - {"idempotency_key"})


def run_probe(
    config: ActionsFile,
    action: str,
    args: dict[str, Any],
    *,
    tenant: str = "",
    connector: Connector | None = None,
    **options: Any,
) -> ProbeReport:
    """Probe ``action`` with ``args``; raises NotATestMode unless its target declares ``test_mode: true``."""
    cfg = config.action(action)
    if not config.targets[cfg.target].test_mode:
        raise NotATestMode(cfg.target)
    missing = missing_args(cfg, args)
    if missing:
        raise ConfigError(f"action {action!r} needs argument(s) {missing} to be probed (--args)")
    if connector is not None:
        return Probe(config, action, args, connector=connector, tenant=tenant, **options).run()
    connectors = ConnectorSet(config)
    try:
        return Probe(config, action, args, connector=connectors.for_action(action), tenant=tenant, **options).run()
    finally:
        connectors.close()
