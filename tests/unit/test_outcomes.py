"""The dispatch policy (workers/engine/outcomes.py) and the reconciler's judgement, as pure functions."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass as A
from outbox.ledger.states import Status, WaitingFor
from workers.engine.outcomes import (
    Ambiguous,
    Cancelled,
    Rejected,
    RetryAt,
    Succeeded,
    after_failed_probe,
    before_send,
    breaker_open,
    breaker_wait,
    decide,
)
from workers.provider.actions import parse_actions
from workers.provider.classify import Classification
from workers.provider.lookups import LookupResult
from workers.reconcile.judge import MAX_LOOKUPS, DispatchAttempt, LookupVerdict, after_not_found, judge

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
DOC = {
    "targets": {"p": {"base_url": "http://127.0.0.1:1"}},
    "actions": {
        "refund": {
            "target": "p",
            "request": {"method": "POST", "path": "/v1/refunds"},
            "provider_idempotency": {"header": "Idempotency-Key", "retention_s": 600},
            "lookup": {
                "request": {"method": "GET", "path": "/v1/refunds", "query": {"idempotency_key": "{idempotency_key}"}},
                "authoritative_not_found": True,
                "settle_s": 5,
            },
            "budget": {"max_attempts": 3, "deadline_s": 60, "base_delay_s": 0.5, "max_delay_s": 10},
        },
    },
}
CONFIG = parse_actions(DOC)
ACTION = CONFIG.action("refund")
REPLAY = parse_actions(DOC | {"actions": {"refund": DOC["actions"]["refund"] | {"on_ambiguous": "replay"}}}).action(
    "refund"
)
FENCED = parse_actions(
    DOC
    | {
        "actions": {
            "refund": DOC["actions"]["refund"] | {"fencing_header": "X-Fencing-Token", "provider_fencing": True}
        }
    }
).action("refund")


def claim(
    n: int = 1,
    *,
    ambiguity: bool = False,
    cancel: bool = False,
    max_attempts=None,
    kind="dispatch",
    proven_absent_through: int = 0,
) -> Claim:
    return Claim(
        operation_id="op",
        fencing_token=n,
        attempt_id=n,
        attempt_number=n,
        kind=kind,
        tenant="t",
        idempotency_key="k",
        action="refund",
        args="{}",
        args_digest="d",
        subject="s",
        worker="w",
        lease_expires_at=T0 + timedelta(seconds=60),
        max_attempts=max_attempts,
        attempt_count=n,
        deadline_at=None,
        created_at=T0,
        cancel_requested=cancel,
        open_ambiguity=ambiguity,
        proven_absent_through=proven_absent_through,
    )


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


def test_a_retry_says_what_it_waits_for():
    told = decide(claim(1), ACTION, c(A.NOT_PROCESSED, status_code=429, retry_after_s=7), now=T0, rng=random.Random(1))
    assert isinstance(told, RetryAt) and told.waiting_for is WaitingFor.RETRY_AFTER
    ours = decide(claim(1), ACTION, c(A.NOT_PROCESSED, status_code=503), now=T0, rng=random.Random(1))
    assert isinstance(ours, RetryAt) and ours.waiting_for is WaitingFor.BACKOFF
    # A Retry-After shorter than our backoff: the backoff decides the wait.
    short = decide(claim(1), ACTION, c(A.NOT_PROCESSED, retry_after_s=0.001), now=T0, rng=random.Random(1))
    assert isinstance(short, RetryAt) and short.delay_s > 0.001 and short.waiting_for is WaitingFor.BACKOFF
    parked = breaker_wait(ACTION, wait_s=5, now=T0)
    assert parked.waiting_for is WaitingFor.BREAKER and parked.refund_attempt


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


def test_cancel_never_sends_and_never_hides_an_earlier_attempt():
    # With an earlier attempt that may still land, a cancel sends nothing more and looks it up:
    # cancelled only once nothing can land, succeeded if it did.
    assert isinstance(before_send(claim(2, cancel=True, ambiguity=True), ACTION, now=T0), Ambiguous)


def test_before_failing_on_budget_after_an_ambiguity_proven_absent_it_looks_once_more():
    # Attempt 1 was ambiguous and a fenced lookup proved it unable to land (proven_absent_through 1):
    # the budget ends on attempt 3, and the ledger asks the provider once more before failing.
    again = decide(claim(3, proven_absent_through=1), ACTION, c(A.NOT_PROCESSED, status_code=503), now=T0)
    assert isinstance(again, Ambiguous) and "once more" in again.why
    # With no lookup to ask, the fence (or a person's word) is all there is.
    no_lookup = ACTION.model_copy(update={"lookup": None})
    assert isinstance(decide(claim(3, proven_absent_through=1), no_lookup, c(A.NOT_PROCESSED), now=T0), Rejected)


def test_breaker_open_waits_without_spending_an_attempt():
    out = breaker_open(claim(), ACTION, wait_s=5, now=T0)
    assert isinstance(out, RetryAt) and out.refund_attempt and out.delay_s == pytest.approx(5)
    assert isinstance(breaker_open(claim(), ACTION, wait_s=90, now=T0), Rejected)


def lookup(outcome, state=None):
    return LookupResult(outcome, outcome, state=state, provider_reference="re_1" if outcome == "found" else None)


def test_reconciler_judgement():
    rng = random.Random(3)
    rc = claim(1, kind="lookup")
    v = judge(rc, ACTION, lookup("found", "succeeded"), now=T0, last_activity=T0, rng=rng)
    assert v.to is Status.SUCCEEDED and v.reference == "re_1"
    # The provider holds it as failed: it took it and failed it, which is not failed_before_commit.
    assert (
        judge(rc, ACTION, lookup("found", "failed"), now=T0, last_activity=T0, rng=rng).to is Status.FAILED_AT_PROVIDER
    )
    # Found pending: the provider has it; accepted, and looked up again later.
    pending = judge(rc, ACTION, lookup("found", "pending"), now=T0, last_activity=T0, rng=rng)
    assert pending.to is Status.ACCEPTED and pending.recheck_in_s > 0 and pending.reference == "re_1"
    accepted = replace(rc, status=Status.ACCEPTED)
    # An accepted operation's "not found" is index lag, never a reason to send again.
    lag = judge(accepted, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=60), last_activity=T0, rng=rng)
    assert lag.to is Status.ACCEPTED
    still = judge(accepted, ACTION, lookup("found", "pending"), now=T0, last_activity=T0, rng=rng)
    assert still.to is Status.ACCEPTED
    spent = judge(
        replace(accepted, attempt_number=MAX_LOOKUPS),
        ACTION,
        lookup("found", "pending"),
        now=T0,
        last_activity=T0,
        rng=rng,
    )
    assert spent.to is Status.RECONCILIATION_REQUIRED
    # Index lag: an early 404 is not proof.
    early = judge(rc, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=1), last_activity=T0, rng=rng)
    assert early.to is Status.OUTCOME_UNKNOWN and early.recheck_in_s == pytest.approx(4)
    late = judge(rc, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=6), last_activity=T0, rng=rng)
    assert late.to is Status.NOT_DISPATCHED
    down = judge(rc, ACTION, lookup("unavailable"), now=T0, last_activity=T0, rng=rng)
    assert down.to is Status.OUTCOME_UNKNOWN and down.recheck_in_s > 0
    last = judge(claim(MAX_LOOKUPS, kind="lookup"), ACTION, lookup("unavailable"), now=T0, last_activity=T0, rng=rng)
    assert last.to is Status.RECONCILIATION_REQUIRED


def test_not_found_after_the_provider_forgot_the_key_is_no_proof():
    # Issue 15: a provider keeps keys retention_s; after that its 404 may hide an effect whose key
    # it forgot, and a re-send would make a second one: a person decides, with the reason.
    rng, rc = random.Random(3), claim(1, kind="lookup")
    retention = ACTION.provider_idempotency.retention_s
    first = T0 - timedelta(seconds=retention)
    inside = judge(
        rc,
        ACTION,
        lookup("not_found"),
        now=T0 + timedelta(seconds=6),
        last_activity=T0,
        rng=rng,
        first_sent=first + timedelta(seconds=7),
    )
    assert inside.to is Status.NOT_DISPATCHED
    after = judge(
        rc, ACTION, lookup("not_found"), now=T0 + timedelta(seconds=6), last_activity=T0, rng=rng, first_sent=first
    )
    assert after.to is Status.RECONCILIATION_REQUIRED and "retention_s" in after.reason and "a person" in after.reason


NOT_FOUND = LookupVerdict(Status.NOT_DISPATCHED, A.NOT_SENT, "authoritative not found after settle_s=5s")


def attempts(*classes: A) -> list[DispatchAttempt]:
    return [DispatchAttempt(n, n, k, None if k is not A.REJECTED else "http_422") for n, k in enumerate(classes, 1)]


def test_not_found_with_budget_left_redispatches_with_the_same_key():
    # The key makes a late landing of attempt 1 harmless; only a fence proves it can no longer land.
    plain = after_not_found(claim(1, kind="lookup", ambiguity=True), ACTION, NOT_FOUND, attempts(A.PENDING), now=T0)
    assert plain.to is Status.NOT_DISPATCHED and not plain.cannot_land
    fenced = after_not_found(claim(1, kind="lookup", ambiguity=True), FENCED, NOT_FOUND, attempts(A.PENDING), now=T0)
    assert fenced.to is Status.NOT_DISPATCHED and fenced.cannot_land and "fenced off" in fenced.reason


@pytest.mark.parametrize(
    "why,rc,tried",
    [
        ("deadline", claim(2, kind="lookup", ambiguity=True), attempts(A.PENDING, A.NOT_SENT)),
        ("attempts", claim(3, kind="lookup", ambiguity=True), attempts(A.AMBIGUOUS, A.NOT_PROCESSED, A.NOT_PROCESSED)),
        ("rejected", claim(2, kind="lookup", ambiguity=True), attempts(A.PENDING, A.REJECTED)),
        ("cancel", claim(2, kind="lookup", ambiguity=True, cancel=True), attempts(A.AMBIGUOUS, A.NOT_SENT)),
    ],
)
def test_not_found_when_it_must_end_fails_only_where_nothing_can_land(why, rc, tried):
    now = T0 + timedelta(seconds=61 if why == "deadline" else 1)
    # The issue-12 timeline: attempt 1 may still land (a frozen worker); not found proves nothing
    # about it, so a person decides instead of failed_before_commit (past the deadline, once the
    # reconciler's own lookups are spent: the next test).
    person = after_not_found(rc, ACTION, NOT_FOUND, tried, now=now, max_lookups=rc.attempt_number)
    assert person.to is Status.RECONCILIATION_REQUIRED, person
    assert "attempt 1 (token 1" in person.reason and "provider_fencing" in person.reason
    # The provider fences: this lookup's newer token locked attempt 1 out.
    ended = after_not_found(rc, FENCED, NOT_FOUND, tried, now=now)
    assert ended.to is (Status.CANCELLED if why == "cancel" else Status.FAILED_BEFORE_COMMIT), ended
    # Nothing open (every earlier attempt proven unable to land): it ends without a fence too.
    closed = after_not_found(replace(rc, open_ambiguity=False), ACTION, NOT_FOUND, tried, now=now)
    assert closed.to is ended.to


def test_not_found_past_the_deadline_looks_again_within_the_reconcilers_budget():
    # The deadline may have gone by while the lookup queued behind others: nothing is sent again,
    # but a late landing of attempt 1 would still be found, so the lookups go on before a person.
    rc = claim(2, kind="lookup", ambiguity=True)
    tried = attempts(A.AMBIGUOUS, A.NOT_SENT)
    late = T0 + timedelta(seconds=61)
    again = after_not_found(rc, ACTION, NOT_FOUND, tried, now=late, rng=random.Random(1), max_lookups=4)
    assert again.to is Status.OUTCOME_UNKNOWN and again.recheck_in_s > 0, again
    assert "nothing is sent again" in again.reason and "attempt 1 (token 1, ambiguous)" in again.reason
    spent = after_not_found(replace(rc, attempt_number=4), ACTION, NOT_FOUND, tried, now=late, max_lookups=4)
    assert spent.to is Status.RECONCILIATION_REQUIRED and "may still take effect" in spent.reason
    # Nothing can land (a provider that fences): it ends at once, as before.
    assert after_not_found(rc, FENCED, NOT_FOUND, tried, now=late).to is Status.FAILED_BEFORE_COMMIT
    # The deadline beside a rejection: the provider has ruled on the key, a person decides now.
    rejected = after_not_found(rc, ACTION, NOT_FOUND, attempts(A.AMBIGUOUS, A.REJECTED), now=late)
    assert rejected.to is Status.RECONCILIATION_REQUIRED


def test_a_poison_intent_at_its_cap_goes_to_a_person_even_when_fenced():
    rc = claim(3, kind="lookup", ambiguity=True)
    out = after_not_found(rc, FENCED, NOT_FOUND, attempts(A.PENDING, A.PENDING, A.PENDING), now=T0)
    assert out.to is Status.RECONCILIATION_REQUIRED and "poison" in out.reason


def test_not_found_at_a_provider_without_keys_never_resends_over_a_request_that_may_land():
    no_keys = ACTION.model_copy(update={"provider_idempotency": None})
    rc = claim(1, kind="lookup", ambiguity=True)
    out = after_not_found(rc, no_keys, NOT_FOUND, attempts(A.PENDING), now=T0)
    assert out.to is Status.RECONCILIATION_REQUIRED and "second effect" in out.reason
    # Nothing open: a plain re-send is the only send there is.
    assert (
        after_not_found(replace(rc, open_ambiguity=False), no_keys, NOT_FOUND, attempts(A.NOT_SENT), now=T0).to
        is Status.NOT_DISPATCHED
    )


def test_a_deadline_missed_in_our_own_backlog_says_so():
    """Under backlog an intent can wait past its deadline before any worker takes it: it is never
    sent (the deadline is the caller's), and the reason says the time was ours, not the provider's."""
    late = T0 + timedelta(seconds=75)
    first = before_send(claim(1), ACTION, now=late)
    assert isinstance(first, Rejected)
    assert first.why == "deadline passed before attempt 1 (60s): 75.0s all of it waiting for a worker (our backlog)"
    again = before_send(claim(2), ACTION, now=late)
    assert isinstance(again, Rejected) and again.why.endswith("75.0s since submit")


def test_a_failed_probe_waits_for_the_reopen_time_in_probe_order_not_on_the_short_backoff():
    # On the short backoff the probing operation is due first when the window ends, and probes
    # again: under load one operation spent its whole budget on probes while others waited.
    c = claim(3)
    backoff = RetryAt(0.3, "http_503; attempt 3/6 after 0.3s")
    waited = after_failed_probe(c, ACTION, backoff, reopen_s=20.0, now=T0)
    assert isinstance(waited, RetryAt) and waited.waiting_for.value == "breaker"
    assert waited.delay_s >= 20.0 and not waited.refund_attempt  # it was sent: the attempt counts
    fresh = after_failed_probe(claim(1), ACTION, backoff, reopen_s=20.0, now=T0)
    assert fresh.delay_s < waited.delay_s  # less budget spent: due first, the next probe
    # Anything but a retry on the backoff is left as it is (a final answer, an ambiguity).
    assert after_failed_probe(c, ACTION, Rejected("x"), reopen_s=20.0, now=T0) == Rejected("x")
    # A reopen past the deadline: the budget's own answer stands (the next claim ends it).
    assert after_failed_probe(c, ACTION, backoff, reopen_s=120.0, now=T0) == backoff


def test_arguments_that_can_never_be_sent_end_the_operation_at_once():
    """Money passed as a number to an action with decimal_args was retried until the budget was
    spent (four attempts, each refused the same way before anything was sent)."""
    from workers.provider.classify import LocalValidationError, classify_exception

    bad_args = classify_exception(LocalValidationError("amount is money and must be a decimal string, got Decimal"))
    assert bad_args.final and bad_args.klass is A.NOT_SENT
    out = decide(claim(1), ACTION, bad_args, now=T0, rng=random.Random(1))
    assert isinstance(out, Rejected) and "not retried" in out.why
    # An earlier attempt still in doubt is looked up first, as for any end (effect_guard).
    assert isinstance(decide(claim(2, ambiguity=True), ACTION, bad_args, now=T0), Ambiguous)
    # Missing credentials can be added while the operation waits: retried within the budget.
    creds = classify_exception(LocalValidationError("tenant 'x' has no credentials", retryable=True))
    assert not creds.final
    assert isinstance(decide(claim(1), ACTION, creds, now=T0, rng=random.Random(1)), RetryAt)
