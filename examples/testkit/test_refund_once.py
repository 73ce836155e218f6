"""Our refunds, tested against a provider that fails on purpose: each refund happens once.

    pip install 'agent-outbox-ledger[testkit]'
    python -m pytest examples/testkit          # pytest.ini names the actions file

The fixture ``outbox_pipeline`` runs actions.yaml through agent-outbox's real pipeline (a SQLite
ledger and broker in a temporary folder, the relay, a worker) with every target pointed at the
sandbox provider, and counts what the provider did per idempotency key.
"""

REFUND = "payments.refund.create"


def refund(order_id: str, amount: str = "25.00") -> dict[str, str]:
    return {"order_id": order_id, "amount": amount, "currency": "EUR", "reason": "damaged"}


def test_the_refund_happens_once_under_the_fault_mix(outbox_pipeline):  # docs/how-to/test-actions.md's five lines
    outbox_pipeline.inject_fault_mix(seed=7)  # each key's first request: 503, 429, a lost answer...
    refund = outbox_pipeline.submit("payments.refund.create", {"order_id": "o-81", "amount": "25", "currency": "EUR"})
    assert outbox_pipeline.settle(refund).status == "succeeded"
    assert outbox_pipeline.effects(refund) == 1


def test_each_refund_happens_once_under_the_fault_mix(outbox_pipeline):
    outbox_pipeline.inject_fault_mix(seed=7)  # every first request fails: 503, 429, lost answers...
    refunds = [outbox_pipeline.submit(REFUND, refund(f"o-{i}")) for i in range(6)]
    for r in refunds:
        assert outbox_pipeline.settle(r).status == "succeeded"
        assert outbox_pipeline.effects(r) == 1
    assert sum(outbox_pipeline.faults_fired().values()) == 6


def test_an_answer_lost_after_the_provider_committed_is_found_not_resent(outbox_pipeline):
    outbox_pipeline.inject_fault("commit_then_drop", count=1)
    r = outbox_pipeline.submit(REFUND, refund("o-81"), key="wf-81:refund:v1")
    settled = outbox_pipeline.settle(r)
    assert settled.status == "succeeded" and settled.reference.startswith("re_")
    assert outbox_pipeline.effects(r) == 1


def test_the_same_key_twice_is_one_refund(outbox_pipeline):
    first = outbox_pipeline.submit(REFUND, refund("o-82"), key="wf-82:refund:v1")
    again = outbox_pipeline.submit(REFUND, refund("o-82"), key="wf-82:refund:v1")
    assert again.operation_id == first.operation_id and not again.new
    assert outbox_pipeline.settle(first).status == "succeeded"
    assert outbox_pipeline.effects(first) == 1


def test_a_refund_the_provider_refuses_did_not_happen(outbox_pipeline):
    r = outbox_pipeline.submit(REFUND, refund("o-83", amount="0.00"))  # the provider answers 422
    settled = outbox_pipeline.settle(r)
    assert settled.status == "failed_before_commit" and settled.outcome == "FAILED_BEFORE_COMMIT"
    assert outbox_pipeline.effects(r) == 0
