"""The provider's "same key, another request" answers (workers/provider/classify.py KEY_CONFLICTS):
never "not executed", never replayed, and a lookup's "not found" after one is a person's to judge."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from outbox.ledger.states import AttemptClass as A
from outbox.ledger.states import Status
from tests.unit.test_outcomes import ACTION, FENCED, NOT_FOUND, REPLAY, T0, attempts, claim
from workers.engine.outcomes import Ambiguous, decide
from workers.provider.classify import classify_response, said_key_conflict
from workers.reconcile.judge import DispatchAttempt, after_not_found

STRIPE = {"error": {"type": "idempotency_error", "message": "Keys for idempotent requests can only be used ..."}}
SANDBOX = {"error": {"type": "idempotency_error", "code": "idempotency_error", "message": "..."}}
TWILIO = {"code": 17534, "message": "Idempotency key payload mismatch", "status": 400}
GOCARDLESS = {
    "error": {
        "type": "invalid_state",
        "code": 409,
        "message": "A resource has already been created with this idempotency key",
        "errors": [
            {
                "reason": "idempotent_creation_conflict",
                "message": "A resource has already been created with this idempotency key",
                "links": {"conflicting_resource_id": "PM0001"},
            }
        ],
    }
}


@pytest.mark.parametrize(
    "status,body,answer",
    [
        (400, STRIPE, "stripe_idempotency_error"),
        (404, STRIPE, "stripe_idempotency_error"),
        (409, SANDBOX, "idempotency_error"),
        (400, SANDBOX, "stripe_idempotency_error"),  # the sandbox as Stripe (params_mismatch_status 400)
        (400, TWILIO, "twilio_17534_payload_mismatch"),
        (409, {**TWILIO, "code": "17534"}, "twilio_17534_payload_mismatch"),
        (409, GOCARDLESS, "gocardless_idempotent_creation_conflict"),
    ],
    ids=["stripe-400", "stripe-404", "sandbox-409", "sandbox-400", "twilio", "twilio-text-code", "gocardless"],
)
def test_a_key_used_for_another_request_is_ambiguous_never_rejected(status, body, answer):
    found = classify_response(status, {}, json.dumps(body).encode())
    assert found.klass is A.AMBIGUOUS and found.key_conflict and not found.provably_not_executed
    assert found.reason == f"http_{status}_{answer}" and said_key_conflict(f"{found.reason}: {body}")
    if body is GOCARDLESS:
        assert found.provider_reference == "PM0001", "the object the key made: for the lookup and the person"


@pytest.mark.parametrize(
    "status,body",
    [
        (409, {"error": {"type": "idempotency_error", "code": "key_in_use"}}),  # the first one still running
        (409, {"error": {"type": "idempotency_error", "code": "stale_token"}}),  # a fenced-off zombie
        (409, STRIPE),  # Stripe's own status for it is 400 or 404 (stripe-python)
        (400, {"error": {"type": "invalid_request_error", "code": "parameter_missing"}}),
        (409, {"error": {"type": "invalid_state", "errors": [{"reason": "mandate_is_inactive"}]}}),
        (500, TWILIO),  # a 5xx is ambiguous anyway, but not this row's
    ],
)
def test_other_answers_keep_their_class(status, body):
    found = classify_response(status, {}, json.dumps(body).encode())
    assert not found.key_conflict and not said_key_conflict(f"{found.reason}: x")


def test_an_action_that_maps_the_status_otherwise_keeps_its_class():
    mapped = classify_response(409, {}, json.dumps(GOCARDLESS).encode(), status_map={409: A.SUCCEEDED})
    assert not mapped.key_conflict and mapped.klass is not A.REJECTED


def test_it_is_looked_up_never_replayed_and_never_failed():
    conflict = classify_response(409, {}, json.dumps(SANDBOX).encode())
    for action in (ACTION, REPLAY):  # REPLAY: on_ambiguous replay would send the same request again
        out = decide(claim(2, proven_absent_through=1), action, conflict, now=T0)
        assert isinstance(out, Ambiguous) and "holds another request under this key" in out.why
    spent = decide(claim(3, proven_absent_through=1), ACTION, conflict, now=T0 + timedelta(seconds=120))
    assert isinstance(spent, Ambiguous)


def test_a_lookup_that_finds_nothing_after_one_hands_it_to_a_person_even_where_the_provider_fences():
    tried = [
        *attempts(A.AMBIGUOUS),
        DispatchAttempt(2, 2, A.AMBIGUOUS, "http_409_idempotency_error: {...}", T0, T0 + timedelta(seconds=1)),
    ]
    for action in (ACTION, FENCED):
        rc = claim(3, kind="lookup", ambiguity=True, proven_absent_through=1)
        person = after_not_found(rc, action, NOT_FOUND, tried, now=T0)
        assert person.to is Status.RECONCILIATION_REQUIRED, person
        assert "answered attempt 2 that it holds another request under this key" in person.reason
    # Proven absent since (a person, the provider's record): it counts no more.
    later = claim(3, kind="lookup", ambiguity=False, proven_absent_through=2)
    assert after_not_found(later, ACTION, NOT_FOUND, tried, now=T0).to is not Status.RECONCILIATION_REQUIRED


@pytest.mark.parametrize("code", ["key_in_use", "idempotency_key_in_use"])
def test_a_key_still_in_use_is_not_processed_never_a_rejection(code):
    """A 409 saying the key's earlier request is still running: this one was not processed, and the
    earlier one may land; a rejection would end the operation failed_before_commit beside it."""
    body = {"error": {"type": "idempotency_error", "code": code, "message": "still being processed"}}
    c = classify_response(409, {}, json.dumps(body).encode(), result_reference="id")
    assert c.klass is A.NOT_PROCESSED and c.reason == "http_409_key_in_use"
