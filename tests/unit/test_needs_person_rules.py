"""The "needs a person" class (issue 50, point 5) as pure logic: the failure table's authority
refusals, the dispatch policy (credentials, on_final_failure: handoff, the wait for the evidence
store), the loaders' refusal of an irreversible action without an approval rule, the evidence store's
health as a process knows it, and what the model is told."""

from __future__ import annotations

import copy
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox.actions.files import ActionsFileError
from outbox.actions.rules import load_action_rules
from outbox.evidence.health import SinkHealth
from outbox.ledger.states import AttemptClass as A
from outbox.ledger.states import Status, WaitingFor
from outbox.ledger.typed_outcome import model_message
from tests.unit.test_outcomes import DOC, NOT_FOUND, T0, attempts, c, claim
from workers.engine.outcomes import NeedsPerson, Rejected, RetryAt, decide, evidence_wait
from workers.provider.actions import load_actions, parse_actions
from workers.provider.classify import classify_response
from workers.reconcile.judge import after_not_found

HANDOFF = parse_actions(
    DOC | {"actions": {"refund": DOC["actions"]["refund"] | {"on_final_failure": "handoff"}}}
).action("refund")
PLAIN = parse_actions(DOC).action("refund")


@pytest.mark.parametrize("status", [401, 403])
def test_a_401_or_403_is_an_authority_refusal_by_default(status):
    got = classify_response(status, {}, b'{"error": {}}', authority_statuses=(401, 403))
    assert got.klass is A.REJECTED and got.authority_refused and got.provably_not_executed
    assert got.reason == f"http_{status}_authority_refused"


def test_a_target_or_an_action_can_say_a_403_is_something_else():
    assert not classify_response(403, {}, b"{}", authority_statuses=(401,)).authority_refused
    # An action that maps the status to another class keeps its mapping (a temporary block: retry).
    mapped = classify_response(403, {}, b"{}", status_map={403: A.NOT_PROCESSED}, authority_statuses=(401, 403))
    assert mapped.klass is A.NOT_PROCESSED and not mapped.authority_refused
    assert not classify_response(422, {}, b"{}", authority_statuses=(401, 403)).authority_refused


def test_targets_default_to_401_and_403_and_refuse_what_is_not_a_client_error():
    cfg = parse_actions(DOC)
    assert cfg.targets["p"].authority_statuses == [401, 403]
    doc = copy.deepcopy(DOC)
    doc["targets"]["p"]["authority_statuses"] = [401, 503]
    with pytest.raises(ActionsFileError, match=r"targets\.p\.authority_statuses: .*\[503\] are not 4xx"):
        parse_actions(doc)


def test_an_authority_refusal_goes_to_a_person_never_a_retry():
    out = decide(claim(1), PLAIN, c(A.REJECTED, status_code=403, authority_refused=True), now=T0)
    assert isinstance(out, NeedsPerson) and out.waiting_for is WaitingFor.CREDENTIALS
    assert "refused our credentials for target p" in out.why and "not retried" in out.why
    # Budget left or not, and whatever on_final_failure says: the credentials are a person's.
    assert isinstance(
        decide(claim(3), HANDOFF, c(A.REJECTED, status_code=401, authority_refused=True), now=T0), NeedsPerson
    )
    doubt = decide(claim(2, ambiguity=True), PLAIN, c(A.REJECTED, status_code=403, authority_refused=True), now=T0)
    assert isinstance(doubt, NeedsPerson) and "earlier attempt of this key may have taken effect" in doubt.why


def test_on_final_failure_handoff_turns_each_failed_before_commit_into_a_person():
    assert isinstance(decide(claim(1), PLAIN, c(A.REJECTED, status_code=422), now=T0), Rejected)
    rejected = decide(claim(1), HANDOFF, c(A.REJECTED, status_code=422, reason="http_422"), now=T0)
    assert isinstance(rejected, NeedsPerson) and rejected.waiting_for is WaitingFor.DECISION
    assert rejected.why.startswith("http_422") and "on_final_failure: handoff" in rejected.why
    spent = decide(claim(3), HANDOFF, c(A.NOT_PROCESSED, status_code=503), now=T0)
    assert isinstance(spent, NeedsPerson) and "budget spent" in spent.why
    # An earlier attempt may have taken effect: looked up first, as before (never a person's guess).
    assert not isinstance(
        decide(claim(2, ambiguity=True), HANDOFF, c(A.REJECTED, status_code=422), now=T0), NeedsPerson
    )
    # The reconciler's end after a "not found" (attempts used up): a person too.
    ended = after_not_found(
        claim(3, kind="lookup"), HANDOFF, NOT_FOUND, attempts(A.AMBIGUOUS, A.NOT_PROCESSED, A.NOT_PROCESSED), now=T0
    )
    assert ended.to is Status.RECONCILIATION_REQUIRED and ended.waiting_for is WaitingFor.DECISION
    plain = after_not_found(
        claim(3, kind="lookup"), PLAIN, NOT_FOUND, attempts(A.AMBIGUOUS, A.NOT_PROCESSED, A.NOT_PROCESSED), now=T0
    )
    assert plain.to is Status.FAILED_BEFORE_COMMIT


def test_the_wait_for_the_evidence_store_spends_nothing_and_slows_down():
    first = evidence_wait(claim(1), PLAIN, now=T0 + timedelta(seconds=2))
    assert isinstance(first, RetryAt) and first.refund_attempt and first.waiting_for is WaitingFor.EVIDENCE
    assert first.delay_s == 1.0
    later = evidence_wait(claim(1), PLAIN, now=T0 + timedelta(seconds=40))
    assert isinstance(later, RetryAt) and later.delay_s == 4.0
    # The deadline (60 s) bounds every wait: past it, it ends as a spent budget does.
    assert isinstance(evidence_wait(claim(1), PLAIN, now=T0 + timedelta(seconds=59)), Rejected)


# -- irreversible needs an approval rule ---------------------------------------------------------
def _irreversible(tmp_path: Path, **approval: Any) -> Path:
    doc = copy.deepcopy(DOC)
    doc["actions"]["refund"]["irreversible"] = True
    # An approval's wait must fit in the provider's key retention.
    doc["actions"]["refund"]["provider_idempotency"]["retention_s"] = 86400
    if approval:
        doc["actions"]["refund"]["approval"] = approval
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("approval", [{}, {"required": "never"}])
def test_an_irreversible_action_without_an_approval_rule_is_refused_at_load(tmp_path, approval):
    path = _irreversible(tmp_path, **approval)
    for load in (load_actions, load_action_rules):  # the workers' loader and the producer's rules
        with pytest.raises(ActionsFileError) as err:
            load(path, environ={})
        message = str(err.value)
        assert str(path) in message and "actions.refund.approval: irreversible: true needs an approval rule" in message
        assert "approval: {required: always}" in message and "required: when" in message


@pytest.mark.parametrize("approval", [{"required": "always"}, {"required": "when", "when": "amount > 500"}])
def test_an_irreversible_action_with_a_person_or_a_condition_loads(tmp_path, approval):
    path = _irreversible(tmp_path, **approval)
    assert load_actions(path, environ={}).action("refund").irreversible
    assert load_action_rules(path, environ={}).is_irreversible("refund")


# -- the evidence store's health, as one process knows it ----------------------------------------
class _Store:
    def __init__(self) -> None:
        self.up, self.probes, self.now = True, 0, 100.0

    def probe(self) -> None:
        self.probes += 1
        if not self.up:
            raise ConnectionRefusedError("refused")


def test_the_store_is_probed_at_most_once_a_second_and_a_change_is_logged_once(caplog):
    store, changes = _Store(), []
    health = SinkHealth(store.probe, clock=lambda: store.now, on_change=changes.append)
    assert health.is_up() and store.probes == 1
    assert health.is_up() and store.probes == 1  # fresh: no round trip
    store.up = False
    with caplog.at_level(logging.INFO, logger="outbox.evidence.health"):
        health.saw(False, ConnectionRefusedError())  # a failed write says so at once
        for _ in range(5):
            store.now += 0.4
            assert not health.is_up()
        store.up = True
        store.now += 1.0
        assert health.is_up()
    assert store.probes == 3  # one per second of asking, not one per question
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "evidence store down" in warnings[0].getMessage()
    assert changes == [True, False, True]


def test_the_gauge_follows_what_the_process_sees():
    from workers.ground import metrics

    store = _Store()

    class Sink:
        separate = True
        health = SinkHealth(store.probe, clock=lambda: store.now)

    metrics.watch_evidence_sink(Sink)
    Sink.health.saw(False)
    assert metrics.PROCESS_REGISTRY.get_sample_value("outbox_evidence_store_down") == 1
    Sink.health.saw(True)
    assert metrics.PROCESS_REGISTRY.get_sample_value("outbox_evidence_store_down") == 0


# -- what the model is told ----------------------------------------------------------------------
def test_the_model_is_told_what_each_case_means():
    op = {"action": "payments.refund.create", "status": "reconciliation_required", "reason": "http_422: no"}
    assert "refused our credentials" in model_message(op | {"waiting_for": "credentials"})
    decided = model_message(op | {"waiting_for": "decision"})
    assert decided.startswith("Not executed: payments.refund.create did not happen (http_422: no)")
    assert "a person decides" in decided
    assert "whether payments.refund.create happened" in model_message(op)
    waiting = model_message({"action": "a", "status": "not_dispatched", "waiting_for": "evidence"})
    assert waiting.startswith("Waiting, nothing sent") and "evidence store is down" in waiting
