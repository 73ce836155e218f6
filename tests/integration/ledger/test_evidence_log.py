"""A success's evidence digests the operation's whole attempt log. For a first dispatch attempt the
log is that attempt alone, so the finalize does not read it back (outbox/evidence/sinks.py
``_whole_log``); the digest must be the one a read gives, byte for byte."""

from __future__ import annotations

from typing import Any

from outbox.evidence.sinks import attempt_log_digests, records_for_claims
from outbox.ledger.claims import claim_due
from outbox.ledger.drivers import driver_for
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, Finalize, finalize_many_if_fenced
from producer import submit

ARGS = {"order_id": "o-1", "amount": "10.00", "currency": "EUR"}


def _reads(monkeypatch: Any, session: Any) -> list[list[str]]:
    """The attempt logs the driver reads (each call's operation ids), passed through to it."""
    driver = driver_for(session)
    read = driver.attempt_log
    seen: list[list[str]] = []

    def counted(session: Any, operation_ids: Any, columns: Any) -> Any:
        seen.append(list(operation_ids))
        return read(session, operation_ids, columns)

    monkeypatch.setattr(driver, "attempt_log", counted)
    return seen


def _success(n: int) -> AttemptReport:
    ref = None if n == 0 else f"re_{n}"
    return AttemptReport(
        AttemptClass.SUCCEEDED,
        status_code=200 + n % 2,
        request_digest=f"{n:064x}",
        response_digest=None if n == 1 else f"{n + 7:064x}",
        provider_reference=ref,
    )


def test_a_first_attempts_evidence_digests_its_log_without_reading_it(ledger, monkeypatch):
    with ledger.sessions.begin() as s:
        ids = [
            submit(
                s, tenant="t", idempotency_key=f"k-{i}", action="payments.refund.create", args=ARGS, subject="a"
            ).operation_id
            for i in range(3)
        ]
    # The third needs a second attempt: its first was refused before it was sent.
    with ledger.sessions.begin() as s:
        [first] = claim_due(s, worker="w", lease_s=30, operation_id=ids[2])
        finalize_many_if_fenced(
            s, [Finalize(first, AttemptReport(AttemptClass.NOT_SENT, status_code=503), Status.NOT_DISPATCHED, "retry")]
        )
    with ledger.sessions.begin() as s:
        reads = _reads(monkeypatch, s)
        claims = claim_due(s, worker="w", lease_s=30, limit=3)
        assert sorted(c.attempt_number for c in claims) == [1, 1, 2]
        finished = [(c, _success(i)) for i, c in enumerate(claims)]
        assert finalize_many_if_fenced(s, [Finalize(c, r, Status.SUCCEEDED, "ok") for c, r in finished]) == [None] * 3
        records = {r.operation_id: r.attempt_log_digest for r in records_for_claims(s, finished)}
    assert reads == [[ids[2]]], "only the operation with an earlier attempt has its log read"
    with ledger.sessions() as s:
        assert records == attempt_log_digests(s, ids), "the same digest as reading the log"
