"""Verdicts: a doorbell's lookup answers judged and written, whatever has arrived in one transaction.

The reconciler (batch.py) claims outcome_unknown operations and looks each up (lookup.py, on the
lookup threads of in_flight.py); here the answers that arrived are judged (judge.py: one read of the
dispatch attempts for every "not found") into verdicts, which become the ledger's fenced settlement
moves (outbox/evidence/settlement.py) in one commit, then the logs, metrics and doorbells that follow.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from outbox.errors import IllegalTransition, StaleFence
from outbox.evidence.handoffs import open_handoff
from outbox.evidence.settlement import SettlementMove, settle_if_fenced, settle_many_if_fenced
from outbox.evidence.sinks import finish_with_evidence, records_for_claims
from outbox.evidence.stored_events import mark_applied
from outbox.ledger import tracing
from outbox.ledger.budget_charges import spent_budget
from outbox.ledger.claims import Claim
from outbox.ledger.envelope import loads_exact
from outbox.ledger.models import Attempt, Operation
from outbox.ledger.states import AttemptClass, AttemptKind, Status
from outbox.ledger.transitions import AttemptReport, commit_even_if_stale
from outbox.ledger.writes import SETTLE_WRITES_FOR
from workers.engine import call_events
from workers.engine.committer import Committer
from workers.engine.handoff_packet import build_packet
from workers.ground import metrics
from workers.provider.actions import ActionConfig
from workers.provider.lookups import LookupResult
from workers.reconcile.judge import DispatchAttempt, LookupVerdict, after_not_found, dispatch_window, judge, recheck
from workers.reconcile.lookup import Asked, LookupBudget

log = logging.getLogger("workers.reconcile.batch")


@dataclass(frozen=True)
class Looked:
    """One claimed operation, looked up (or not: ``found`` None) and judged, not yet settled."""

    claim: Claim
    found: LookupResult | None
    verdict: LookupVerdict
    action: ActionConfig | None = None
    waited: str | None = None  # a declared limit the lookup waited for (its event says so)
    events: tuple[int, ...] = ()  # webhook events that answered it instead (stored_events.py): marked its own

    def report(self) -> AttemptReport:
        found, verdict, action, claim = self.found, self.verdict, self.action, self.claim
        redactor = action.redactor(loads_exact(claim.args)) if action is not None and claim.args else None
        error = None if verdict.to is Status.SUCCEEDED else (f"{found.reason}: " if found else "") + verdict.reason
        return AttemptReport(
            klass=verdict.klass,
            status_code=found.status_code if found else None,
            provider_reference=verdict.reference or (found.provider_reference if found else None),
            latency_s=found.latency_s if found else None,
            error=redactor.text(error) if redactor else error,
            waited=self.waited,
        )

    def result(self) -> dict[str, Any] | None:
        found, action = self.found, self.action
        # The provider's answer: kept on a success, and on an accepted operation while it finishes.
        result = found.obj if found and self.verdict.to in (Status.SUCCEEDED, Status.ACCEPTED) else None
        if result is not None and action is not None:
            redactor = action.redactor(loads_exact(self.claim.args)) if self.claim.args else None
            result = action.masked_response(result, redactor)
        return result

    def fields(self) -> dict[str, Any]:
        return self.claim.log_fields()


def _write_settlement(rec: Committer, session: Session, item: Looked, report: AttemptReport, to: Status) -> None:
    """The fenced move of one looked-up operation (and its handoff when a person must decide)."""
    verdict = item.verdict
    settle_if_fenced(
        session,
        item.claim,
        report,
        to=to,
        reason=verdict.reason,
        recheck_in_s=verdict.recheck_in_s,
        result=item.result(),
        cannot_land=verdict.cannot_land,
        waiting_for=verdict.waiting_for,
    )
    _mark_events(session, item, to)
    if to is Status.RECONCILIATION_REQUIRED:
        op = session.get(Operation, item.claim.operation_id)
        assert op is not None
        packet = build_packet(
            session, op, reason=verdict.reason, action=item.action, actions=rec.actions, candidates=verdict.candidates
        )
        open_handoff(session, item.claim.operation_id, reason=verdict.reason, packet=packet, recheck=verdict.recheck)


def _mark_events(session: Session, item: Looked, to: Status) -> None:
    if item.events:
        mark_applied(session, item.events, operation_id=item.claim.operation_id, tenant=item.claim.tenant, moved_to=to)


def settle_looked(rec: Committer, looked: Sequence[Looked]) -> dict[str, LookupVerdict]:
    """Settle a doorbell's lookups in ONE transaction: one commit (and WAL flush) per batch, and the
    common settlements (found done, send again, look again later) as one statement each, pipelined
    in one round trip like a worker's finalize (settlement.settle_many_if_fenced). One refused
    settlement leaves the others alone: a stale token keeps its lookup row as evidence (as
    commit_even_if_stale does alone); a "no effect" the guard refuses is undone (its savepoint).
    A separate evidence database needs its own write before each success: one by one then.
    After the commit: logs, metrics, and what follows (late successes applied, re-dispatch)."""
    if rec.evidence.separate:
        return {item.claim.operation_id: _settle(rec, item) for item in looked}
    if not looked:
        return {}
    applied: list[tuple[Looked, Status]] = []
    stale: list[tuple[Looked, StaleFence]] = []
    refused_ids: list[str] = []
    reports = {item.claim.operation_id: item.report() for item in looked}
    one_statement = [i for i in looked if i.verdict.to in SETTLE_WRITES_FOR and not i.verdict.cannot_land]
    others = [i for i in looked if i not in one_statement]
    with rec.sessions.begin() as session:
        refusals = settle_many_if_fenced(
            session,
            [
                SettlementMove(
                    i.claim,
                    reports[i.claim.operation_id],
                    i.verdict.to,
                    i.verdict.reason,
                    i.verdict.recheck_in_s,
                    i.result(),
                )
                for i in one_statement
            ],
        )
        for item, refused in zip(one_statement, refusals):
            if refused is None:
                applied.append((item, item.verdict.to))
                _mark_events(session, item, item.verdict.to)
            else:
                stale.append((item, refused))
        for item in others:
            # A "no effect" or a handoff can be refused after its first write (the guard: a
            # success is on record) and is then undone alone, in its savepoint.
            savepoint = session.begin_nested()
            try:
                _write_settlement(rec, session, item, reports[item.claim.operation_id], item.verdict.to)
            except StaleFence as exc:
                savepoint.commit()  # the lookup row keeps the answer, marked stale
                stale.append((item, exc))
                continue
            except IllegalTransition as exc:
                savepoint.rollback()
                log.info("no-effect settlement refused (%s): applying the success on record", exc, extra=item.fields())
                refused_ids.append(item.claim.operation_id)
                continue
            savepoint.commit()
            applied.append((item, item.verdict.to))
        # Evidence with the successes themselves: same transaction, one query, one insert.
        succeeded = [(i.claim, reports[i.claim.operation_id]) for i, to in applied if to is Status.SUCCEEDED]
        rec.evidence.write_many(records_for_claims(session, succeeded), session=session)
    for item, refusal in stale:
        log.info("stale fence: lookup kept as evidence (%s)", refusal, extra=item.fields())
    stale_successes = {i.claim.attempt_id: i.result() for i, _ in stale if i.verdict.to is Status.SUCCEEDED}
    if stale_successes:
        rec.late_successes(attempt_results=stale_successes)
    if refused_ids:
        rec.late_successes(operation_ids=refused_ids)
    redispatch = []
    for item, to in applied:
        _trace_settled(item, to)
        _log_settled(item, to)
        call_events.settled(item, to)
        metrics.record_outcome(to)
        if to is Status.NOT_DISPATCHED:
            redispatch.append(item.claim.operation_id)
    if redispatch:
        rec.doorbell.ring_dispatch_after_commit(redispatch)
    return {item.claim.operation_id: item.verdict for item in looked}


def _settle(rec: Committer, item: Looked) -> LookupVerdict:
    """One operation alone (a separate evidence database: its write comes before the success)."""
    claim, verdict = item.claim, item.verdict
    report = item.report()
    applied = verdict.to
    try:
        if verdict.to is Status.SUCCEEDED:
            applied = finish_with_evidence(
                rec.sessions,
                rec.evidence,
                claim,
                report,
                lambda session, to: _write_settlement(rec, session, item, report, to),
            )
        else:
            commit_even_if_stale(
                rec.sessions, lambda session: _write_settlement(rec, session, item, report, verdict.to)
            )
    except StaleFence as exc:
        log.info("stale fence: lookup kept as evidence (%s)", exc, extra=item.fields())
        if verdict.to is Status.SUCCEEDED:
            rec.late_successes(attempt_results={claim.attempt_id: item.result()})
        return verdict
    except IllegalTransition as exc:
        # "No effect" refused by the ledger's guard: a success arrived on another attempt while
        # we looked. It settles the operation instead.
        log.info("no-effect settlement refused (%s): applying the success on record", exc, extra=item.fields())
        rec.late_successes(operation_ids=[claim.operation_id])
        return verdict
    _trace_settled(item, applied)
    _log_settled(item, applied)
    call_events.settled(item, applied)
    metrics.record_outcome(applied)
    if applied is Status.NOT_DISPATCHED:
        rec.doorbell.ring_dispatch_after_commit([claim.operation_id])
    return verdict


def _trace_settled(item: Looked, applied: Status) -> None:
    """``outbox.settle`` (what the lookup settled, after its commit) in the intent's trace, and
    ``outbox.handoff`` beneath it when it went to a person."""
    if not tracing.enabled():
        return
    claim, verdict = item.claim, item.verdict
    attributes = tracing.attributes_of(claim) | {"outbox.status": applied.value, "outbox.reason": verdict.reason}
    with tracing.span("outbox.settle", parent=claim.traceparent, attributes=attributes) as settled:
        if applied in (Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER):
            settled.fail(verdict.reason)
        if applied is Status.RECONCILIATION_REQUIRED:
            with tracing.span("outbox.handoff", parent=settled.traceparent, attributes=attributes):
                pass


def _log_settled(item: Looked, applied: Status) -> None:
    fields, reason = item.fields(), item.verdict.reason
    if applied in (Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER):
        log.error("%s: %s", applied.value, reason, extra=fields)  # a final failure
    elif applied is Status.RECONCILIATION_REQUIRED:
        # A handoff to a person is one of the two ERRORs of the normal path (DESIGN.md, Logging).
        log.error("handed to a person: %s", reason, extra=fields)
    else:
        log.info("reconcile: %s -> %s", reason, applied.value, extra=fields)


def settle_answers(
    rec: Committer, items: Sequence[tuple[random.Random, Asked]], budget: LookupBudget
) -> dict[str, LookupVerdict]:
    """Judge what the provider answered (one read of the dispatch attempts for every "not found")
    and settle it all in one transaction (settle_looked).

    The reconciler's budget counts lookups that were sent: one sent back by a declared limit or
    parked by an open breaker is on record (not_sent) but spends nothing. Its row still takes a
    number, so where the row number reaches the budget the ones never asked are counted (one read,
    only then) and judged out."""
    judged = [a for _, a in items if a.early is None and (a.found is not None or a.cut is not None)]
    not_found = [a.claim.operation_id for a in judged if a.found is not None and a.found.outcome == "not_found"]
    near_budget = [a.claim.operation_id for a in judged if a.claim.attempt_number >= budget.max_lookups]
    attempts: dict[str, list[DispatchAttempt]] = {}
    not_asked: dict[str, int] = {}
    scopes: dict[str, str] = {}
    if not_found or near_budget:
        with rec.sessions() as session:
            attempts = dispatch_attempts(session, not_found) if not_found else {}
            not_asked = _lookups_not_asked(session, near_budget) if near_budget else {}
            scoped = [a.claim for a in judged if a.claim.operation_id in not_found and a.claim.budget_scope]
            scopes = _scopes_spent(rec, session, scoped) if scoped else {}
    looked = [
        _judged(
            rec,
            a,
            rng,
            attempts.get(a.claim.operation_id, []),
            budget,
            not_asked.get(a.claim.operation_id, 0),
            scopes.get(a.claim.operation_id),
        )
        for rng, a in items
    ]
    return settle_looked(rec, [replace(i, verdict=budget.with_recheck(i.verdict, i.action)) for i in looked])


def _judged(
    rec: Committer,
    asked: Asked,
    rng: random.Random,
    attempts: list[DispatchAttempt],
    budget: LookupBudget,
    not_asked: int = 0,
    scope_spent: str | None = None,
) -> Looked:
    claim, action, found = asked.claim, asked.action, asked.found
    max_lookups, max_delay_s = budget.max_lookups, budget.max_delay_s
    # Judged as the lookup it is among those sent; settled (and numbered) as the row it is.
    sent = replace(claim, attempt_number=claim.attempt_number - not_asked) if not_asked else claim
    if asked.cut is not None and asked.early is None:
        return Looked(
            claim, None, recheck(sent, asked.cut, rng, max_lookups=max_lookups, max_delay_s=max_delay_s), action
        )
    if asked.early is not None or found is None or action is None:
        assert asked.early is not None
        return Looked(claim, None, asked.early, action, events=asked.events)
    first_sent = last_activity = None
    if found.outcome == "not_found":  # only "not found" is judged against the dispatch attempts
        target = rec.actions.target_of(action)
        first_sent, last_activity = dispatch_window(
            attempts, call_timeout_s=target.timeout_s + target.connect_timeout_s, after=claim.proven_absent_through
        )
    verdict = judge(
        sent,
        action,
        found,
        now=claim.now(),
        last_activity=last_activity,
        first_sent=first_sent,
        rng=rng,
        max_lookups=max_lookups,
        max_delay_s=max_delay_s,
    )
    if verdict.to is Status.NOT_DISPATCHED:  # only after "not found": the attempts were read above
        verdict = after_not_found(
            sent,
            action,
            verdict,
            attempts,
            now=claim.now(),
            rng=rng,
            max_lookups=max_lookups,
            max_delay_s=max_delay_s,
            scope_spent=scope_spent,
        )
    return Looked(claim, found, verdict, action, asked.waited)


def _scopes_spent(rec: Committer, session: Session, claims: Sequence[Claim]) -> dict[str, str]:
    """For operations in a budget scope found absent: why their conversation has no retry left (one
    read per operation; only for those: an operation without a scope costs nothing here)."""
    out: dict[str, str] = {}
    for claim in claims:
        assert claim.budget_scope is not None
        budgets = rec.actions.budgets_of(claim.action)
        found = spent_budget(session, tenant=claim.tenant, scope=claim.budget_scope, budgets=budgets)
        if found is not None:
            out[claim.operation_id] = found.why
    return out


def _lookups_not_asked(session: Session, operation_ids: Sequence[str]) -> dict[str, int]:
    """Per operation, its lookup rows never asked (breaker open, a limit with no room: lookup.py):
    not_sent with no answer timed. A lookup the provider answered has a latency, even one whose
    verdict is not_sent ("not found")."""
    rows = session.execute(
        select(Attempt.operation_id, func.count())
        .where(
            Attempt.operation_id.in_(list(operation_ids)),
            Attempt.kind == AttemptKind.LOOKUP.value,
            Attempt.attempt_class == AttemptClass.NOT_SENT.value,
            Attempt.latency_s.is_(None),
        )
        .group_by(Attempt.operation_id)
    ).all()
    return {op: int(n) for op, n in rows}


def dispatch_attempts(session: Session, operation_ids: Sequence[str]) -> dict[str, list[DispatchAttempt]]:
    """One read of these operations' dispatch attempts, each in order: both judgements of a "not
    found" (dispatch_window, after_not_found)."""
    rows = session.execute(
        select(
            Attempt.operation_id,
            Attempt.attempt_number,
            Attempt.fencing_token,
            Attempt.attempt_class,
            Attempt.error,
            Attempt.started_at,
            Attempt.ended_at,
        )
        .where(Attempt.operation_id.in_(list(operation_ids)), Attempt.kind == AttemptKind.DISPATCH.value)
        .order_by(Attempt.operation_id, Attempt.attempt_number)
    ).all()
    out: dict[str, list[DispatchAttempt]] = {}
    for r in rows:
        out.setdefault(r.operation_id, []).append(
            DispatchAttempt(
                r.attempt_number, r.fencing_token, AttemptClass(r.attempt_class), r.error, r.started_at, r.ended_at
            )
        )
    return out
