"""Fan-out: one claimed operation's call to the downstream, and what the attempt proved.

Nothing here writes to the ledger but a retry's charge to its conversation's budget, made right
before it leaves (scope_budget.py): an attempt returns its report (for the attempt row) and its
outcome (for the one guarded move that finalize.py makes of it). Which thread makes which call,
and when, is in_flight.py's business.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

from breaker import Admissions, Open, counts_as_failure
from outbox.approvals.decisions import lapse_reason
from outbox.ledger import failpoints, tracing
from outbox.ledger.claims import Claim
from outbox.ledger.envelope import loads_exact
from outbox.ledger.request_record import RequestRecord
from outbox.ledger.states import AttemptClass
from outbox.ledger.transitions import AttemptReport
from workers.dispatch.gate import SendChecks
from workers.dispatch.same_request import Resend, key_header_of, route, without_action
from workers.dispatch.scope_budget import charge_before_send
from workers.engine import call_events
from workers.engine.authority import approval_lapse, refusal
from workers.engine.downstream import Downstream, addressed
from workers.engine.outcomes import (
    AttemptOutcome,
    FailedAtProvider,
    NeedsApproval,
    NeedsPerson,
    Rejected,
    Succeeded,
    after_failed_probe,
    before_send,
    breaker_open,
    deadline_of,
    decide,
    evidence_wait,
    limit_wait,
    object_wait,
)
from workers.ground import metrics
from workers.pacing import Deferred
from workers.provider.actions import ActionConfig
from workers.provider.connectors import AttemptResult, HttpConnector

# Outcomes that end the operation as a failure, or hand it to a person after a refusal: their attempt
# span's status is ERROR (and only theirs).
FINAL_FAILURES = (Rejected, FailedAtProvider, NeedsPerson)

Attempted = tuple[Claim, AttemptReport, AttemptOutcome, ActionConfig | None]


def attempt_claimed(downstream: Downstream, admissions: Admissions, claim: Claim, checks: SendChecks) -> Attempted:
    try:
        action = downstream.actions.action(claim.action)
    except KeyError as exc:
        admissions.give_back(claim.operation_id)
        report = AttemptReport(AttemptClass.NOT_SENT, error=str(exc))
        return claim, report, without_action(claim), None
    report, outcome = attempt(downstream, admissions, claim, action, checks)
    return claim, report, outcome, action


def attempt(
    downstream: Downstream,
    admissions: Admissions,
    claim: Claim,
    action: ActionConfig,
    checks: SendChecks,
) -> tuple[AttemptReport, AttemptOutcome]:
    """One attempt of a claimed operation, as a span of the intent's trace (``outbox.attempt``, a
    client span): its class, the provider's status, and ERROR only for a final failure. Untraced,
    the attempt alone: nothing is built for a span on the hot path."""
    if not tracing.enabled():
        return _attempt(downstream, admissions, claim, action, checks)
    with tracing.span(
        "outbox.attempt", parent=claim.traceparent, client=True, attributes=tracing.attributes_of(claim)
    ) as span:
        report, outcome = _attempt(downstream, admissions, claim, action, checks)
        span.set(
            **{
                "outbox.target": action.target,
                "outbox.attempt.class": report.klass.value,
                "http.response.status_code": report.status_code,
                "outbox.outcome": type(outcome).__name__,
            }
        )
        if isinstance(outcome, FINAL_FAILURES):
            span.fail(report.error or type(outcome).__name__)
        return report, outcome


def _attempt(
    downstream: Downstream,
    admissions: Admissions,
    claim: Claim,
    action: ActionConfig,
    checks: SendChecks,
) -> tuple[AttemptReport, AttemptOutcome]:
    """One attempt of a claimed operation: nothing here writes to the ledger.

    ``admissions``: the doorbell's breaker answers (the operation's own, asked before the claim, or
    its target's shared one; otherwise the breaker is asked now). ``checks``: the approval on record
    for the claims whose action needs one (None: none on record), and the operation that holds back
    those whose business object is not free (gate.py).
    """
    early = before_send(claim, action, now=claim.now())
    if early is None:  # a revoked submitting key, a stopped subject: nothing leaves in their name
        early = refusal(downstream.authority, claim, overridden=claim.operation_id in checks.overridden)
    version = downstream.actions.action_version(claim.action)
    chosen = route(
        claim,
        version,
        # Asked only of a request on record (a hook connector is never handed one).
        http=claim.sent is None or isinstance(downstream.connectors.for_action(claim.action), HttpConnector),
        base_url=downstream.actions.target_of(action).base_url,
        key_header=key_header_of(action),
    )
    if early is None and isinstance(chosen, (NeedsPerson, Rejected)):
        early = chosen  # the request its key names cannot be sent (again): nothing is sent
    if early is None and claim.operation_id in checks.approvals:
        grant = checks.approvals[claim.operation_id]
        lapsed = lapse_reason(
            grant, args_digest=claim.args_digest, policy_version=action.approval.policy_version, now=claim.now()
        ) or approval_lapse(downstream.authority, grant)
        if lapsed is not None:
            early = NeedsApproval(lapsed)
    if early is None and (blocker := checks.held_back.get(claim.operation_id)) is not None:
        early = object_wait(claim, action, blocker, now=claim.now())
    if early is None and claim.operation_id in checks.evidence_down:
        early = evidence_wait(claim, action, now=claim.now())
    if early is not None:
        admissions.give_back(claim.operation_id)
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        return AttemptReport(AttemptClass.NOT_SENT, error=_why(early)), early
    decision = admissions.answer_for(claim.operation_id, action.target)
    if isinstance(decision, Open):
        outcome = breaker_open(claim, action, wait_s=decision.wait_s, now=claim.now())
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        return AttemptReport(AttemptClass.NOT_SENT, error=f"breaker open for {decision.wait_s:.3f}s more"), outcome
    paced = downstream.pace(claim, action.target, deadline=deadline_of(claim, action))
    if isinstance(paced, Deferred):
        admissions.give_back(claim.operation_id)  # a probe not sent is handed on at once
        metrics.record_limit_released(action.target, paced.limit)
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        outcome = limit_wait(claim, action, wait_s=paced.wait_s, why=paced.why, now=claim.now())
        error = f"{paced.why}: not sent, no room for {paced.wait_s:.3f}s"
        return AttemptReport(AttemptClass.NOT_SENT, error=error), outcome
    # The last question before the send: a retry's charge to its conversation (none: no statement).
    refused = charge_before_send(downstream.sessions, downstream.actions, claim, action)
    if refused is not None:
        downstream.done(paced)
        admissions.give_back(claim.operation_id)
        metrics.record_attempt(action.target, AttemptClass.NOT_SENT, None)
        return AttemptReport(AttemptClass.NOT_SENT, error=_why(refused)), refused
    try:
        connector = downstream.connectors.for_action(claim.action)
        failpoints.hit("dispatch.before_send", claim.idempotency_key)
        args = loads_exact(claim.args)
        # The request on record goes again as it is; a hook connector is never handed one.
        recorded: dict[str, Any] = {"recorded": chosen.request} if isinstance(chosen, Resend) else {}
        call_events.sending(claim)
        result = connector.send(claim.action, action, args=args, **addressed(claim), **recorded)
    finally:
        downstream.done(paced)
    c = result.classification
    # Transport failures, 5xx and 429 count against the breaker; business 4xx never do.
    failed = counts_as_failure(c.status_code, transport_error=_is_transport(result))
    admissions.went(decision, failure=failed)
    metrics.record_attempt(action.target, c.klass, result.latency_s)
    metrics.record_retry_billed(action.target, claim.attempt_number, c.klass)
    outcome = decide(claim, action, c, now=claim.now())
    if failed and decision.probe:
        reopen_s = downstream.actions.target_of(action).breaker.reset_timeout_s
        outcome = after_failed_probe(claim, action, outcome, reopen_s=reopen_s, now=claim.now())
    report = replace(_report(result, version, key_header_of(action)), waited=paced.note())
    return private(action, args, report, outcome)


def private(
    action: ActionConfig, args: Any, report: AttemptReport, outcome: AttemptOutcome
) -> tuple[AttemptReport, AttemptOutcome]:
    """What is stored about an attempt, without the action's secrets: the response's sensitive
    fields masked, and the intent's sensitive values redacted wherever the provider echoed them."""
    if not action.sensitive_args and not action.sensitive_response_fields:
        return report, outcome
    redactor = action.redactor(args)
    report = replace(report, error=redactor.text(report.error))
    if isinstance(outcome, Succeeded):
        return report, replace(outcome, result=action.masked_response(outcome.result, redactor))
    return report, replace(outcome, why=redactor.text(outcome.why) or "")


def _is_transport(result: AttemptResult) -> bool:
    # No HTTP answer counts against the breaker; a request we could not build (our bug) does not.
    return result.classification.origin == "transport"


def _sent(result: AttemptResult, version: str | None, key_header: str | None) -> RequestRecord | None:
    """The request this attempt put on the wire, to record under its key (outbox/ledger/request_record.py),
    with the header its key went in; None when it cannot have left. A hook connector's own request:
    its version and digest only."""
    if result.classification.klass is AttemptClass.NOT_SENT:
        return None
    sent = result.sent
    if sent is None:
        return RequestRecord(version, digest=result.request_digest or None)
    body = sent.body.decode() if sent.body is not None else None
    return RequestRecord(version, sent.method, sent.path, body, sent.digest, key_header)


def _report(result: AttemptResult, version: str | None = None, key_header: str | None = None) -> AttemptReport:
    c = result.classification
    digest = None
    if c.body is not None:
        digest = hashlib.sha256(json.dumps(c.body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return AttemptReport(
        klass=c.klass,
        status_code=result.status_code,
        request_digest=result.request_digest or None,
        provider_request_id=c.provider_request_id,
        provider_reference=c.provider_reference,
        response_digest=digest,
        retry_after_s=c.retry_after_s,
        latency_s=result.latency_s,
        error=None if c.klass is AttemptClass.SUCCEEDED else f"{c.reason}: {result.raw_error or ''}"[:2000],
        sent=_sent(result, version, key_header),
    )


def _why(outcome: AttemptOutcome) -> str:
    return getattr(outcome, "why", "") or ""
