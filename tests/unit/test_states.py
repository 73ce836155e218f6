"""The transition table in outbox/ledger/states.py is the one place that says which status may follow which."""

from __future__ import annotations

import re

import pytest

from outbox.ledger.models import STATUS_VALUES, Handoff, Operation
from outbox.ledger.states import (
    ALLOWED,
    AWAITING_OUTCOME,
    EFFECT,
    MEANING,
    NO_EFFECT,
    TERMINAL,
    WAITING_MEANING,
    HandoffStatus,
    Resolution,
    Status,
    WaitingFor,
    is_allowed,
    sources_of,
)


def test_every_status_takes_part_in_the_table():
    # A status that no transition reaches or leaves is either dead code or a missing edge.
    mentioned = {s for pair in ALLOWED for s in pair}
    assert mentioned == set(Status)


def test_every_status_has_a_meaning():
    # `ops show` prints MEANING[status]; a missing entry would crash the CLI.
    assert set(MEANING) == set(Status)
    assert all(MEANING[s].strip() for s in Status)


def test_every_wait_has_a_meaning():
    # `ops show` prints WAITING_MEANING[waiting_for] beside the status.
    assert set(WAITING_MEANING) == set(WaitingFor)
    assert all(WAITING_MEANING[w].strip() for w in WaitingFor)


def test_succeeded_has_no_outgoing_transitions():
    assert [dst for (src, dst) in ALLOWED if src is Status.SUCCEEDED] == []


@pytest.mark.parametrize("terminal", sorted(NO_EFFECT))
def test_a_no_effect_state_is_left_only_for_a_person_when_evidence_contradicts_it(terminal):
    # Evidence wins: a provider-confirmed success after "no effect" is never silently left as it
    # was; the operation goes to a person (outbox/evidence/late_successes.py), and nowhere else.
    assert [dst for (src, dst) in ALLOWED if src is terminal] == [Status.RECONCILIATION_REQUIRED]
    # The other ends: the effect, and abandoned (a person stopped looking; it claims neither).
    assert NO_EFFECT | {Status.SUCCEEDED, Status.ABANDONED} == TERMINAL


def test_a_late_success_settles_every_state_that_claims_no_outcome_yet():
    for src in AWAITING_OUTCOME:
        assert all(is_allowed(src, dst) for dst in EFFECT), src


def test_terminal_set_is_what_the_design_says():
    assert TERMINAL == {
        Status.SUCCEEDED,
        Status.FAILED_BEFORE_COMMIT,
        Status.FAILED_AT_PROVIDER,
        Status.CANCELLED,
        Status.ABANDONED,
    }


def test_accepted_is_settled_only_by_what_the_provider_says_and_never_sent_again():
    # Accepted is not completed: the provider has it. Only its lookups (or a late answer) move it, to
    # done, to failed at the provider, or to a person; it never goes back to a send.
    assert sources_of(Status.ACCEPTED) == {Status.DISPATCHING, Status.OUTCOME_UNKNOWN, Status.ACCEPTED}
    assert {dst for (src, dst) in ALLOWED if src is Status.ACCEPTED} == {
        Status.ACCEPTED,
        Status.SUCCEEDED,
        Status.COMMITTED_EVIDENCE_DEGRADED,
        Status.FAILED_AT_PROVIDER,
        Status.RECONCILIATION_REQUIRED,
    }


def test_failed_at_provider_only_from_what_the_provider_said():
    # The provider took it and reported it failed: a 2xx that says so, or a lookup (a handoff's
    # re-check too, or a webhook for a re-checked handoff). Never a guess.
    assert sources_of(Status.FAILED_AT_PROVIDER) == {
        Status.DISPATCHING,
        Status.OUTCOME_UNKNOWN,
        Status.ACCEPTED,
        Status.RECONCILIATION_REQUIRED,
    }
    assert not is_allowed(Status.ACCEPTED, Status.FAILED_BEFORE_COMMIT)


def test_failed_before_commit_only_after_a_dispatch_or_a_lookup():
    # Failure needs proof that nothing happened: only a worker's attempt or a reconciler's lookup gives it.
    assert sources_of(Status.FAILED_BEFORE_COMMIT) == {Status.DISPATCHING, Status.OUTCOME_UNKNOWN}


def test_outcome_unknown_never_returns_to_dispatching_directly():
    # Nothing is re-sent without proof: the only way back to a dispatch goes through not_dispatched.
    assert not is_allowed(Status.OUTCOME_UNKNOWN, Status.DISPATCHING)
    assert sources_of(Status.DISPATCHING) == {Status.NOT_DISPATCHED}


def test_cancel_only_before_anything_was_sent():
    # dispatching -> cancelled is the worker that saw the cancel flag before sending; outcome_unknown
    # -> cancelled the reconciler that proved no earlier attempt can still land. Never from a person's
    # handoff, and never from a terminal state.
    assert sources_of(Status.CANCELLED) == {
        Status.NOT_DISPATCHED,
        Status.AWAITING_APPROVAL,
        Status.DISPATCHING,
        Status.OUTCOME_UNKNOWN,
    }


def test_committed_evidence_degraded_is_never_retried():
    outgoing = {dst for (src, dst) in ALLOWED if src is Status.COMMITTED_EVIDENCE_DEGRADED}
    assert outgoing == {Status.SUCCEEDED}


def test_every_transition_names_its_event():
    assert all(isinstance(why, str) and why.strip() for why in ALLOWED.values())


def test_db_check_constraint_lists_exactly_the_enum():
    values = re.findall(r"'([a-z_]+)'", STATUS_VALUES)
    assert sorted(values) == sorted(s.value for s in Status)
    assert len(values) == len(set(values))
    checks = [
        str(c.sqltext)
        for c in Operation.__table__.constraints
        if getattr(c, "name", None) and "status" in str(c.name) and hasattr(c, "sqltext")
    ]
    status_checks = [c for c in checks if c.startswith("status IN")]
    assert status_checks == [f"status IN ({STATUS_VALUES})"]


def test_handoff_checks_list_exactly_the_enums():
    """The words a handoff's status and resolution may take are the enums' (the database refuses others)."""
    checks = {c.name: str(c.sqltext) for c in Handoff.__table__.constraints if hasattr(c, "sqltext")}
    status = next(text for name, text in checks.items() if str(name).endswith("status"))
    resolution = next(text for name, text in checks.items() if str(name).endswith("resolution"))
    assert sorted(re.findall(r"'([a-z-]+)'", status)) == sorted(s.value for s in HandoffStatus)
    assert sorted(re.findall(r"'([a-z-]+)'", resolution)) == sorted(r.value for r in Resolution)
