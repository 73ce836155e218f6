"""Authority re-checked at the send, as pure decisions: what a claim becomes when its submitting key was
revoked or its subject stopped (workers/engine/authority.py), how a process's view of who may act is
refreshed and when it is no longer trusted (outbox/ledger/authority.py), and what the model is told."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox.approvals.decisions import Grant
from outbox.ledger.authority import AuthorityBoard, Revocation, Snapshot, Stop
from outbox.ledger.states import WaitingFor
from outbox.ledger.stops import HOLD_S
from outbox.ledger.typed_outcome import with_outcome
from tests.unit.test_outcomes import claim
from workers.engine.authority import approval_lapse, is_hold, refusal
from workers.engine.outcomes import Ambiguous, Cancelled, NeedsPerson, RetryAt

T0 = datetime(2026, 12, 9, 12, 0, tzinfo=UTC)
REVOKED = Revocation("key:7", T0, "alice", cancels_queued=False)
STOP = Stop("t", "s", "bob", T0, "looping")


class _Fixed:
    """An Authority whose snapshot is given (or whose reading fails)."""

    def __init__(self, snap: Snapshot | None) -> None:
        self.snap = snap

    def snapshot(self) -> Snapshot:
        if self.snap is None:
            raise ConnectionError("ledger away")
        return self.snap


def _ask(snap: Snapshot | None, *, overridden: bool = False, **over: Any) -> Any:
    return refusal(_Fixed(snap), replace(claim(), **over), overridden=overridden)  # type: ignore[arg-type]


def test_a_claim_with_its_authority_in_force_is_sent():
    assert _ask(Snapshot()) is None
    assert _ask(Snapshot({"key:7": REVOKED}), submitted_by="key:8") is None
    assert refusal(None, claim()) is None  # nobody asked (a worker built without authority)


def test_a_revoked_submitting_key_goes_to_a_person_or_is_cancelled_or_looked_up():
    said = _ask(Snapshot({"key:7": REVOKED}), submitted_by="key:7")
    assert isinstance(said, NeedsPerson) and said.waiting_for is WaitingFor.AUTHORITY
    assert "the submitting key key:7 was revoked at 2026-12-09T12:00:00+00:00 by alice" in said.why
    cancelling = replace(REVOKED, cancels_queued=True)
    said = _ask(Snapshot({"key:7": cancelling}), submitted_by="key:7")
    assert isinstance(said, Cancelled) and "--cancel-queued" in said.why
    # An earlier attempt may have landed: never stranded, never cancelled blind: looked up.
    said = _ask(Snapshot({"key:7": cancelling}), submitted_by="key:7", open_ambiguity=True)
    assert isinstance(said, Ambiguous) and "looking it up" in said.why
    # A person resolved it "not executed" after the revocation: sent in their name.
    assert _ask(Snapshot({"key:7": REVOKED}), submitted_by="key:7", overridden=True) is None


def test_a_stopped_subject_is_held_until_resumed_and_the_attempt_not_counted():
    said = _ask(Snapshot(stops={("t", "s"): STOP}))
    assert isinstance(said, RetryAt) and is_hold(said)
    assert said.refund_attempt and said.delay_s == HOLD_S and said.waiting_for is WaitingFor.STOPPED
    assert "stopped by bob" in said.why and "looping" in said.why and "subjects resume" in said.why
    assert _ask(Snapshot(stops={("t2", "s"): STOP})) is None  # a stop is per tenant


def test_who_may_act_unreadable_sends_nothing():
    said = _ask(None)
    assert isinstance(said, RetryAt) and not is_hold(said) and said.refund_attempt
    assert said.waiting_for is WaitingFor.AUTHORITY and "could not be read" in said.why


def test_an_approval_given_with_a_key_revoked_since_no_longer_counts():
    grant = Grant(12, "d", "v1", "carol (api:key-7)", T0, approver_identity="key:7")
    lapsed = approval_lapse(_Fixed(Snapshot({"key:7": REVOKED})), grant)  # type: ignore[arg-type]
    assert lapsed is not None and "approval 12" in lapsed and "no longer counts" in lapsed
    assert approval_lapse(_Fixed(Snapshot()), grant) is None  # type: ignore[arg-type]
    at_the_cli = replace(grant, approver_identity=None)
    assert approval_lapse(_Fixed(Snapshot({"key:7": REVOKED})), at_the_cli) is None  # type: ignore[arg-type]


def test_the_board_reads_again_after_a_second_and_trusts_an_old_reading_only_so_long():
    now = [0.0]
    reads: list[float] = []
    board = AuthorityBoard(refresh_s=1.0, trust_s=3.0, clock=lambda: now[0])

    def read() -> Snapshot:
        reads.append(now[0])
        return Snapshot(read_at=now[0])

    board.current(read)
    now[0] = 0.9
    board.current(read)
    assert reads == [0.0]  # younger than a second: no query
    now[0] = 1.0
    assert board.current(read).read_at == 1.0

    def fails() -> Snapshot:
        raise ConnectionError("ledger away")

    now[0] = 3.5
    assert board.current(fails).read_at == 1.0  # a blip: the last reading, 2.5 s old
    now[0] = 4.0
    with pytest.raises(ConnectionError):
        board.current(fails)  # 3 s old: not acted on
    board.forget()
    assert board.current(read).read_at == 4.0


@pytest.mark.parametrize(
    ("status", "waiting_for", "outcome", "words"),
    [
        ("not_dispatched", "stopped", "PENDING", "On hold, nothing sent: an operator stopped this agent"),
        ("reconciliation_required", "authority", "NEEDS_HUMAN", "the key that submitted payments.refund.create was"),
    ],
)
def test_the_model_is_told_what_holds_it(status, waiting_for, outcome, words):
    said = with_outcome({"status": status, "waiting_for": waiting_for, "action": "payments.refund.create"})
    assert said["outcome"] == outcome and words in said["model_message"] and "resubmit" in said["model_message"]
