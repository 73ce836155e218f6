"""The typed outcome: every state has one, and each sentence tells the model what it may do."""

from __future__ import annotations

import pytest

from outbox.ledger.states import Status
from outbox.ledger.typed_outcome import OUTCOME_OF, SETTLED, Outcome, outcome_of, with_outcome


def test_every_state_has_exactly_one_outcome():
    assert set(OUTCOME_OF) == set(Status)
    assert SETTLED == {
        Outcome.SUCCEEDED,
        Outcome.FAILED_BEFORE_COMMIT,
        Outcome.FAILED_AT_PROVIDER,
        Outcome.NEEDS_HUMAN,
        Outcome.AWAITING_APPROVAL,
        Outcome.CANCELLED,
        Outcome.ABANDONED,  # a person closed it: nothing more happens by itself
        Outcome.REFUSED,  # an answer, never a state: nothing was stored, nothing to wait for
    }
    assert Outcome.REFUSED not in set(OUTCOME_OF.values())


@pytest.mark.parametrize(
    ("status", "words"),
    [
        ("succeeded", ["Done:", "RF-9001", "do not retry"]),
        ("committed_evidence_degraded", ["Done:", "do not retry"]),
        ("failed_before_commit", ["Not executed", "amount over limit", "new idempotency key"]),
        ("outcome_unknown", ["Outcome unknown", "may have executed", "do not retry"]),
        ("reconciliation_required", ["A person is deciding", "do not retry"]),
        ("awaiting_approval", ["approval", "nothing has been sent"]),
        ("not_dispatched", ["Queued, not sent yet", "do not resubmit"]),
        ("dispatching", ["not finished"]),
        ("cancelled", ["Cancelled", "did not happen"]),
        ("accepted", ["Accepted, not finished", "still processing", "Do not resubmit"]),
        ("failed_at_provider", ["Failed at the provider", "did not take effect", "new idempotency key"]),
        ("abandoned", ["Abandoned", "may or may not have taken effect", "Do not retry"]),
    ],
)
def test_model_messages(status: str, words: list[str]):
    op = {
        "status": status,
        "action": "payments.refund.create",
        "result": {"reference": "RF-9001"} if status == "succeeded" else None,
        "reason": "rejected by the provider (amount over limit)",
    }
    out = with_outcome(op)
    assert out["outcome"] == outcome_of(status).value
    assert all(w in out["model_message"] for w in words), out["model_message"]
