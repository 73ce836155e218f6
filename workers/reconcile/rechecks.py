"""A handoff's re-checks, judged and settled: what one more lookup proves for a case a person holds.

The reconciler claims due re-checks beside its outcome_unknown lookups (batch.py), looks them up on
the same threads, breakers and limits (lookup.py), and hands the answers here (in_flight.py). The
ledger's side is outbox/evidence/rechecks.py; here, for each answer:

- found, done -> succeeded; found, failed at the provider -> failed_at_provider: the handoff
  resolves itself ("resolved by the provider's evidence", the lookup row as the evidence);
- found, still pending; not found by a lookup that is not authoritative, or still inside its
  settle window, or while an earlier attempt may still land (no provider_fencing); the lookup down,
  cut, or not asked (breaker open, no room under a limit): nothing settles it, the next check is
  scheduled;
- not found by an authoritative lookup that fenced every earlier attempt off (or none can land):
  the absence is proven and written down; re-checks stop, the person decides (not-executed sends it
  again under the same key, or retry as a new intent);
- two matching objects, the key retention over, the action no longer looked up: re-checks stop.

Nothing here sends a request, and nothing here decides what only a person may.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from outbox.evidence import rechecks
from outbox.ledger.states import AttemptClass, Status
from workers.engine import call_events
from workers.engine.committer import Committer
from workers.ground import metrics
from workers.provider.actions import ActionConfig
from workers.reconcile.judge import DispatchAttempt, LookupVerdict, dispatch_window
from workers.reconcile.lookup import Asked, LookupBudget
from workers.reconcile.verdicts import Looked, dispatch_attempts

log = logging.getLogger(__name__)
RR = Status.RECONCILIATION_REQUIRED


@dataclass(frozen=True)
class RecheckFinding:
    """What one re-check proved: a status the provider's answer settles it to (``to``: None, it stays
    with its person), what the lookup row records, and whether re-checks go on."""

    to: Status | None
    klass: AttemptClass
    reason: str
    reference: str | None = None
    proven_absent: bool = False
    stop: str | None = None  # why no further re-check: nothing more a lookup can tell


def judge_recheck(
    asked: Asked, action: ActionConfig | None, attempts: Sequence[DispatchAttempt], *, call_timeout_s: float
) -> RecheckFinding:
    """Pure: what this answer proves for a case (the module docstring)."""
    claim, found = asked.claim, asked.found
    if action is None or action.lookup is None:
        return RecheckFinding(
            None, AttemptClass.NOT_SENT, "its action is no longer looked up", stop="no lookup declared"
        )
    if asked.early is not None:
        return RecheckFinding(None, asked.early.klass, asked.early.reason)
    if asked.cut is not None or found is None:
        return RecheckFinding(None, AttemptClass.AMBIGUOUS, asked.cut or "no answer")
    if found.outcome == "found":
        if found.state == "succeeded":
            return RecheckFinding(
                Status.SUCCEEDED, AttemptClass.SUCCEEDED, "found at the provider", found.provider_reference
            )
        if found.state == "failed":
            return RecheckFinding(
                Status.FAILED_AT_PROVIDER,
                AttemptClass.REJECTED,
                "the provider took it and holds it as failed/cancelled",
                found.provider_reference,
            )
        return RecheckFinding(
            None, AttemptClass.ACCEPTED, f"accepted by the provider, still {found.state}", found.provider_reference
        )
    if found.outcome == "ambiguous":
        return RecheckFinding(
            None,
            AttemptClass.AMBIGUOUS,
            f"{len(found.candidates)} objects at the provider match this intent ({', '.join(found.candidates)})",
            stop="looking again finds the same objects: a person picks",
        )
    if found.outcome != "not_found":
        return RecheckFinding(None, AttemptClass.AMBIGUOUS, f"lookup unavailable: {found.reason}")
    spec = action.lookup
    if not spec.authoritative_not_found:
        return RecheckFinding(
            None, AttemptClass.AMBIGUOUS, "not found, and this lookup is not authoritative (index lag?)"
        )
    now = claim.now()
    first, last = dispatch_window(attempts, call_timeout_s=call_timeout_s, after=claim.proven_absent_through)
    if last is not None and now < last + timedelta(seconds=spec.settle_s):
        return RecheckFinding(None, AttemptClass.AMBIGUOUS, "not found yet, inside the settle window")
    keys = action.provider_idempotency
    if keys is not None and first is not None and (now - first).total_seconds() > keys.retention_s:
        return RecheckFinding(
            None,
            AttemptClass.AMBIGUOUS,
            f"not found, but the provider keeps keys only retention_s={keys.retention_s:g}s",
            stop="the provider's key retention is over: a lookup by key proves nothing any more",
        )
    if action.provider_fencing or not claim.open_ambiguity:
        how = "every earlier attempt fenced off by this lookup" if action.provider_fencing else "no attempt can land"
        return RecheckFinding(
            None,
            AttemptClass.NOT_SENT,
            f"authoritative not found ({how}): proven not executed",
            proven_absent=True,
            stop="proven not executed: resolve it not-executed (sent again, same key) or retry it as a new intent",
        )
    return RecheckFinding(
        None,
        AttemptClass.AMBIGUOUS,
        "authoritative not found, but an earlier attempt may still land (the action declares no provider_fencing)",
    )


def settle_rechecks(
    rec: Committer, items: Sequence[tuple[random.Random, Asked]], budget: LookupBudget
) -> dict[str, LookupVerdict]:
    """Judge and settle re-checks, each in its own transaction (they are few: hours apart)."""
    not_found = [a.claim.operation_id for _, a in items if a.found is not None and a.found.outcome == "not_found"]
    attempts = {}
    if not_found:
        with rec.sessions() as session:
            attempts = dispatch_attempts(session, not_found)
    out: dict[str, LookupVerdict] = {}
    for rng, asked in items:
        claim = asked.claim
        action = rec.actions.actions.get(claim.action)
        timeout_s = 0.0
        if action is not None:
            target = rec.actions.target_of(action)
            timeout_s = target.timeout_s + target.connect_timeout_s
        judged = judge_recheck(asked, action, attempts.get(claim.operation_id, []), call_timeout_s=timeout_s)
        verdict = LookupVerdict(judged.to or RR, judged.klass, judged.reason, reference=judged.reference)
        looked = Looked(claim, asked.found, verdict, action, asked.waited)
        report = looked.report()
        fields = claim.log_fields()
        at = None
        try:
            with rec.sessions.begin() as session:
                if judged.to is not None:
                    moved = rechecks.settle_found(
                        session,
                        claim,
                        report,
                        to=judged.to,
                        reason=judged.reason,
                        sink=rec.evidence,
                        result=looked.result(),
                    )
                    settled = moved is not None
                else:
                    settled, at = rechecks.settle_open(
                        session,
                        claim,
                        report,
                        reason=judged.reason,
                        terms=budget.rechecks,
                        rng=rng,
                        proven_absent=judged.proven_absent,
                        stop=judged.stop,
                    )
                    moved = RR if settled else None
        except Exception:  # noqa: BLE001 - one case must not hold back the others: its lease brings it back
            log.warning("re-check not settled; looked up again once its lease expires", exc_info=True, extra=fields)
            continue
        if moved is RR and at is not None:  # Flower's lookup task says when it is looked up again
            verdict = replace(verdict, recheck_in_s=max((at - claim.now()).total_seconds(), 0.0))
        out[claim.operation_id] = verdict
        if moved is not None:
            call_events.settled(replace(looked, verdict=verdict), moved)
        if moved is None:
            log.info("re-check refused: the case moved on meanwhile (its lookup kept as evidence)", extra=fields)
            if judged.to is Status.SUCCEEDED:
                rec.late_successes(attempt_results={claim.attempt_id: looked.result()})
            elif judged.to is not None:
                rec.late_successes(operation_ids=[claim.operation_id])
            continue
        if moved is RR:
            log.info("re-check: %s; the handoff stays with its person", judged.reason, extra=fields)
            continue
        metrics.record_outcome(moved)
        log.info("handoff resolved by the provider's evidence: %s -> %s", judged.reason, moved.value, extra=fields)
    return out
