"""Handoffs as cases, the pure parts: the slowing schedule of re-checks and its end, which handoffs are
re-checked, what one re-check proves, the derived key of a retry, abandoned in the state table, and
the alert on cases nobody took."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.evidence.checks import RecheckTerms, next_check, next_check_in_s, plan
from outbox.evidence.retries import derived_key
from outbox.ledger.claims import Claim
from outbox.ledger.clock import LedgerClock
from outbox.ledger.states import (
    ALLOWED,
    AWAITING_OUTCOME,
    NO_EFFECT,
    PERSON_RESOLUTIONS,
    AttemptClass,
    AttemptKind,
    Resolution,
    Status,
    WaitingFor,
    sources_of,
)
from workers.provider.actions import parse_actions
from workers.provider.lookups import LookupResult
from workers.reconcile.judge import DispatchAttempt, LookupVerdict, with_recheck
from workers.reconcile.lookup import Asked
from workers.reconcile.rechecks import judge_recheck
from workers.sandbox.scenario import action, actions_doc

ROOT = Path(__file__).resolve().parents[2]
TERMS = RecheckTerms(first_s=60, max_s=6 * 3600, without_keys_s=7 * 86400)
NOW = dt.datetime(2026, 12, 9, 12, 0, tzinfo=dt.UTC)


def test_rechecks_slow_down_from_minutes_to_hours_and_never_past_the_cap():
    rng = random.Random(7)
    ages = [0, 60, 120, 600, 3600, 4 * 3600, 30 * 3600]
    delays = [next_check_in_s(age, TERMS, rng) for age in ages]
    assert all(0.9 * min(max(a, 60), 6 * 3600) <= d <= min(max(a, 60), 6 * 3600) for a, d in zip(ages, delays))
    assert delays[0] < 61 and delays[-1] > 5 * 3600  # a minute at first, hours later


def test_rechecks_end_with_the_providers_key_retention():
    rng = random.Random(1)
    opened = NOW - dt.timedelta(hours=2)
    until = NOW + dt.timedelta(minutes=10)
    assert next_check(NOW, opened, until, TERMS, rng) == until  # the last one falls on the last useful moment
    assert next_check(until, opened, until, TERMS, rng) is None
    assert plan(TERMS, 86400).horizon_s == 86400  # keys: their retention
    assert plan(TERMS, None).horizon_s == 7 * 86400  # no keys: OUTBOX_HANDOFF_RECHECK_WITHOUT_KEYS_S


@pytest.mark.parametrize(
    ("key", "retry_of", "derived"),
    [
        ("wf-1:refund", None, "wf-1:refund:retry-1"),
        ("wf-1:refund:retry-1", "op-1", "wf-1:refund:retry-2"),
        ("acme:wf-1:refund:retry-2", "op-2", "acme:wf-1:refund:retry-3"),
        ("my:retry-7", None, "my:retry-7:retry-1"),  # a caller's own key that looks like one counts as plain
    ],
)
def test_a_retry_derives_its_key_and_counts_on(key: str, retry_of: str | None, derived: str):
    assert derived_key(key, retry_of=retry_of) == derived


def test_abandoned_is_an_end_a_person_reaches_and_only_evidence_leaves():
    assert sources_of(Status.ABANDONED) == {Status.RECONCILIATION_REQUIRED, Status.ABANDONED}
    assert {dst for (src, dst) in ALLOWED if src is Status.ABANDONED} == {
        Status.ABANDONED,  # retried as a new intent after it was abandoned
        Status.SUCCEEDED,
        Status.COMMITTED_EVIDENCE_DEGRADED,
    }
    assert Status.ABANDONED in AWAITING_OUTCOME and Status.ABANDONED not in NO_EFFECT
    # The provider's word only: a person never says "failed at the provider" for it.
    assert Resolution.FAILED_AT_PROVIDER not in PERSON_RESOLUTIONS


def _actions(**over: Any) -> Any:
    return parse_actions(actions_doc("http://sandbox.test", actions={"refund": action("/v1/refunds", **over)}))


def _claim(*, open_ambiguity: bool = True) -> Claim:
    return Claim(
        operation_id="op-1",
        fencing_token=5,
        attempt_id=9,
        attempt_number=3,
        kind=AttemptKind.LOOKUP,
        tenant="t1",
        idempotency_key="k",
        action="refund",
        args="{}",
        args_digest="d",
        subject="s",
        worker="r",
        lease_expires_at=NOW,
        max_attempts=None,
        attempt_count=1,
        deadline_at=None,
        created_at=NOW - dt.timedelta(hours=3),
        cancel_requested=False,
        open_ambiguity=open_ambiguity,
        clock=LedgerClock(NOW),
        status=Status.RECONCILIATION_REQUIRED,
    )


SENT = [
    DispatchAttempt(
        1, 1, AttemptClass.AMBIGUOUS, started_at=NOW - dt.timedelta(hours=3), ended_at=NOW - dt.timedelta(hours=3)
    )
]


def _judge(found: LookupResult, *, claim: Claim | None = None, **over: Any) -> Any:
    act = _actions(**over).actions["refund"]
    return judge_recheck(Asked(claim or _claim(), act, found), act, SENT, call_timeout_s=1.5)


def test_a_recheck_that_finds_the_answer_settles_it():
    done = _judge(LookupResult("found", "ok", state="succeeded", provider_reference="re_1"))
    assert (done.to, done.klass, done.reference) == (Status.SUCCEEDED, AttemptClass.SUCCEEDED, "re_1")
    failed = _judge(LookupResult("found", "ok", state="failed", provider_reference="re_1"))
    assert failed.to is Status.FAILED_AT_PROVIDER


@pytest.mark.parametrize(
    ("found", "over", "words"),
    [
        (LookupResult("unavailable", "HTTP 503", status_code=503), {}, "lookup unavailable"),
        (LookupResult("found", "ok", state="pending"), {}, "still pending"),
        (LookupResult("not_found", "404"), {}, "may still land"),  # unfenced: a late landing could still show up
    ],
)
def test_a_recheck_that_finds_nothing_final_leaves_the_case_and_checks_again(found, over, words):
    got = _judge(found, **over)
    assert got.to is None and got.stop is None and not got.proven_absent and words in got.reason


def test_a_fenced_authoritative_not_found_is_proof_written_down_for_the_person():
    got = _judge(LookupResult("not_found", "404"), provider_fencing=True)
    assert got.to is None and got.proven_absent and got.stop and "retry it as a new intent" in got.stop


def test_rechecks_stop_when_looking_again_cannot_help():
    two = _judge(LookupResult("ambiguous", "2", candidates=("re_1", "re_2")))
    assert two.to is None and two.stop and "a person picks" in two.stop
    retention = {"header": "Idempotency-Key", "retention_s": 600}
    forgot = _judge(LookupResult("not_found", "404"), provider_idempotency=retention)
    assert forgot.stop and "key retention is over" in forgot.stop


def test_only_handoffs_a_providers_answer_could_settle_are_rechecked():
    act = _actions().actions["refund"]
    lookup_down = LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, "budget spent")
    assert with_recheck(lookup_down, act, TERMS).recheck == plan(TERMS, 86400)
    for why in (WaitingFor.CREDENTIALS, WaitingFor.DECISION, WaitingFor.REQUEST):
        person = LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.NOT_SENT, "x", waiting_for=why)
        assert with_recheck(person, act, TERMS).recheck is None, why
    two = LookupVerdict(Status.RECONCILIATION_REQUIRED, AttemptClass.AMBIGUOUS, "x", candidates=("a", "b"))
    assert with_recheck(two, act, TERMS).recheck is None
    no_lookup = _actions(lookup=None).actions["refund"]
    assert with_recheck(lookup_down, no_lookup, TERMS).recheck is None
    settled = LookupVerdict(Status.SUCCEEDED, AttemptClass.SUCCEEDED, "found")
    assert with_recheck(settled, act, TERMS).recheck is None


def test_an_alert_fires_on_cases_nobody_took():
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r["alert"] == "OutboxHandoffUnowned"]
    assert "outbox_handoffs_unowned" in rule["expr"] and "handoffs take" in rule["annotations"]["runbook"]
