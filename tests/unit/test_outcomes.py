"""The dispatch policy (workers/outcomes.py) and the reconciler's judgement, as pure functions."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from outbox.claims import Claim
from outbox.states import AttemptClass as A
from outbox.states import Status
from workers.actions import parse_actions
from workers.classify import Classification
from workers.connectors import LookupResult
from workers.outcomes import Ambiguous, Cancelled, Rejected, RetryAt, Succeeded, before_send, breaker_open, decide
from workers.reconcile import MAX_LOOKUPS, judge

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
DOC = {
    "targets": {"p": {"base_url": "http://127.0.0.1:1"}},
    "actions": {
        "refund": {
            "target": "p",
            "request": {"method": "POST", "path": "/v1/refunds"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 600},
            "lookup": {"request": {"method": "GET", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}},
                       "authoritative_not_found": True, "settle_s": 5},
            "budget": {"max_attempts": 3, "deadline_s": 60, "base_delay_s": 0.5, "max_delay_s": 10},
        },
    },
}
CONFIG = parse_actions(DOC)
ACTION = CONFIG.action("refund")
REPLAY = parse_actions(DOC | {"actions": {"refund": DOC["actions"]["refund"] | {"on_ambiguous": "replay"}}}).action("refund")


def claim(n: int = 1, *, ambiguity: bool = False, cancel: bool = False, max_attempts=None, kind="dispatch") -> Claim:
    return Claim(operation_id="op", fencing_token=n, attempt_id=n, attempt_number=n, kind=kind, tenant="t",
                 idempotency_key="k", action="refund", args="{}", args_digest="d", subject="s", worker="w",
                 lease_expires_at=T0 + timedelta(seconds=60), max_attempts=max_attempts, attempt_count=n,
                 deadline_at=None, created_at=T0, cancel_requested=cancel, open_ambiguity=ambiguity)


def c(klass, **kw) -> Classification:
    return Classification(klass, kw.pop("reason", klass.value), **kw)


def test_success_and_rejection():
    assert isinstance(decide(claim(), ACTION, c(A.SUCCEEDED, provider_reference="re_1"), now=T0), Succeeded)
    assert isinstance(decide(claim(), ACTION, c(A.REJECTED, status_code=422), now=T0), Rejected)
    # After an unresolved ambiguous attempt, a rejection proves nothing about the earlier one.
    assert isinstance(decide(claim(2, ambiguity=True), ACTION, c(A.REJECTED, status_code=409), now=T0), Ambiguous)


def test_not_processed_waits_at_least_retry_after_then_budget_ends_it():
    out = decide(claim(1), ACTION, c(A.NOT_PROCESSED, status_code=503, retry_after_s=7), now=T0, rng=random.Random(1))
    assert isinstance(out, RetryAt) and out.delay_s >= 7
    assert isinstance(decide(claim(3), ACTION, c(A.NOT_PROCESSED, status_code=503), now=T0), Rejected)
    spent = decide(claim(3, ambiguity=True), ACTION, c(A.NOT_PROCESSED, status_code=503), now=T0)
    assert isinstance(spent, Ambiguous)  # never failed_before_commit after an ambiguous attempt
    # A Retry-After past the deadline spends the budget instead of waiting beyond it.
    assert isinstance(decide(claim(1), ACTION, c(A.NOT_PROCESSED, retry_after_s=120), now=T0), Rejected)


def test_intent_cap_tightens_the_action_budget():
    assert isinstance(decide(claim(2, max_attempts=2), ACTION, c(A.NOT_SENT), now=T0), Rejected)
    assert isinstance(decide(claim(2), ACTION, c(A.NOT_SENT), now=T0), RetryAt)


@pytest.mark.parametrize("reason", ["read_timeout", "remote_protocol_error", "500"])
def test_ambiguous_parks_unless_replay_is_declared_and_inside_retention(reason):
    assert isinstance(decide(claim(), ACTION, c(A.AMBIGUOUS, reason=reason), now=T0), Ambiguous)
    assert isinstance(decide(claim(), REPLAY, c(A.AMBIGUOUS, reason=reason), now=T0), RetryAt)
    late = T0 + timedelta(seconds=601)
    assert isinstance(decide(claim(), REPLAY, c(A.AMBIGUOUS, reason=reason), now=late), Ambiguous)


def test_before_send_checks():
    assert before_send(claim(), ACTION, now=T0) is None
    assert isinstance(before_send(claim(cancel=True), ACTION, now=T0), Cancelled)
    assert isinstance(before_send(claim(4), ACTION, now=T0), Rejected)
    assert isinstance(before_send(claim(), ACTION, now=T0 + timedelta(seconds=61)), Rejected)
    assert isinstance(before_send(claim(2, ambiguity=True), ACTION, now=T0 + timedelta(seconds=61)), Ambiguous)


def test_breaker_open_waits_without_spending_an_attempt():
    out = breaker_open(claim(), ACTION, reopens_at=T0 + timedelta(seconds=5), now=T0)
    assert isinstance(out, RetryAt) and out.refund_attempt and out.delay_s == pytest.approx(5)
    assert isinstance(breaker_open(claim(), ACTION, reopens_at=T0 + timedelta(seconds=90), now=T0), Rejected)


def lookup(outcome, state=None):
    return LookupResult(outcome, outcome, state=state, provider_reference="re_1" if outcome == "found" else None)


def test_reconciler_judgement():
    rng = random.Random(3)
    rc = claim(1, kind="lookup")
    v = judge(rc, ACTION, lookup("found", "succeeded"), now=T0, last_activity=T0, rng=rng)
    assert v.to is Status.SUCCEEDED and v.reference == "re_1"
    assert judge(rc, ACTION, lookup("found", "failed"), now=T0, last_activity=T0, rng=rng).to is Status.FAILED_BEFORE_COMMIT
    assert judge(rc, ACTION, lookup("found", "pending"), now=T0, last_activity=T0, rng=rng).to is Status.OUTCOME_UNKNOWN
    # Index lag: an early 404 is not proof.
    early = judge(rc, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=1), last_activity=T0, rng=rng)
    assert early.to is Status.OUTCOME_UNKNOWN and early.recheck_in_s == pytest.approx(4)
    late = judge(rc, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=6), last_activity=T0, rng=rng)
    assert late.to is Status.NOT_DISPATCHED
    down = judge(rc, ACTION, lookup("unavailable"), now=T0, last_activity=T0, rng=rng)
    assert down.to is Status.OUTCOME_UNKNOWN and down.recheck_in_s > 0
    last = judge(claim(MAX_LOOKUPS, kind="lookup"), ACTION, lookup("unavailable"), now=T0, last_activity=T0, rng=rng)
    assert last.to is Status.RECONCILIATION_REQUIRED
