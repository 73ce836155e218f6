"""The gate of a dispatch doorbell: which of its operations may be claimed and called now.

A doorbell's first read (nothing locked) says which ids are due and what their deadlines are; each
one's target's breaker is asked before the claim (Admissions, breaker/admissions.py). While a
downstream's breaker is open an operation is not claimed at all: it is parked until the breaker may
close (outbox/ledger/waits.py), which costs no fencing token, attempt row or budget. Past its
deadline it is claimed anyway, and the claim ends it (the budget is spent either way).

After the claim, three more questions before anything is sent: the operations the claim took along
(not rung by this doorbell) are admitted once per target; the approvals on record are read for the
actions that need one (judged again right before the send, dispatch/fan_out.py); and an operation
whose action declares a business object takes that object's hold, or learns which operation holds it
back (outbox/ledger/objects.py; it is then sent back to wait, nothing sent).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from breaker import Admissions, BreakerRegistry, Open
from outbox.approvals.decisions import Grant, grants
from outbox.evidence.sinks import EvidenceSink
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim, read_due
from outbox.ledger.clock import LedgerClock, as_utc
from outbox.ledger.envelope import loads_exact
from outbox.ledger.hot_path import LedgerConnection
from outbox.ledger.objects import Blocker, take_hold
from outbox.ledger.waits import park_for_breaker
from workers.engine.authority import Authority
from workers.engine.outcomes import AttemptOutcome, RetryAt, breaker_wait, deadline_of
from workers.provider.actions import ActionConfig, ActionsFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Due:
    """A not_dispatched, due operation as read before claiming (enough for the deadline)."""

    action: str
    created_at: datetime
    deadline_at: datetime | None
    max_attempts: int | None
    attempt_count: int
    clock: LedgerClock  # the database's time when read: deadlines are judged on it


@dataclass(frozen=True)
class _ToPark:
    """A due operation whose breaker said wait: parked after the claim (``Gate.park``)."""

    action: ActionConfig
    decision: Open
    due: _Due


@dataclass(frozen=True)
class Passed:
    """What the gate let through of a doorbell's ids."""

    wanted: list[str]  # due and not waiting for a breaker: to be claimed
    to_park: dict[str, _ToPark]  # waiting for their breaker: left unclaimed, parked after the claim
    rung_due: bool  # any rung id was due (none: the claim takes whatever else is due)


@dataclass(frozen=True)
class SendChecks:
    """What the gate found, after the claim, for the send of each claim: the approval on record (None:
    none) of those whose action needs one, and the operation that holds back those whose business
    object is not free."""

    approvals: dict[str, Grant | None] = field(default_factory=dict)
    held_back: dict[str, Blocker] = field(default_factory=dict)
    # Those whose action requires evidence while the separate evidence store is down: not sent.
    evidence_down: frozenset[str] = frozenset()
    # Those whose submitting key was revoked and whom a person resolved "not executed" since: sent in
    # that person's name (workers/engine/authority.py).
    overridden: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Gate:
    """What the gate takes: the doorbell task's connection (the due read), sessions (parks and
    approvals), the actions file (targets, budgets), the breakers, and who parks (the actor)."""

    ledger: LedgerConnection
    sessions: sessionmaker[Session]
    actions: ActionsFile
    breakers: BreakerRegistry
    worker_id: str
    # The evidence store and OUTBOX_EVIDENCE_REQUIRED: an action that requires evidence is not sent
    # while a separate store is down (None: nothing requires it here).
    evidence: EvidenceSink | None = None
    evidence_required: bool = False
    # Who may still act (workers/engine/authority.py); None: nobody is asked.
    authority: Authority | None = None

    def admissions(self) -> Admissions:
        """A doorbell's breaker answers, shared by its calls (the reconciler's are its own)."""
        return Admissions(self.breakers)

    def admit(self, operation_ids: Sequence[str], admissions: Admissions) -> Passed:
        """Ask each due id's breaker (once per target while it is closed): open and the deadline
        allows the wait, the operation is to be parked (``park``, after the claim); otherwise it goes
        to the claim, holding its answer (a probe is that operation's; an open breaker past the
        deadline ends it at the claim).

        Every id is asked before anything is written: a half-open breaker's probe held here is
        claimed a few Redis round trips later, not after this doorbell's parks. Parking first let
        another process, whose doorbell named the same id, park it meanwhile (the probe out, it
        waits too); the claim then found it not due, the probe was given back and went to whoever
        asked next, whatever budget that operation had left (CI: one spent 4/4 attempts on probes
        while nine had spent none)."""
        dues = read_due_ops(self.ledger, operation_ids)
        to_park: dict[str, _ToPark] = {}
        for op_id, due in dues.items():
            known = self.actions.actions.get(due.action)
            if known is None:
                continue  # claimed, and ended there: nothing is sent for an unknown action
            decision = admissions.ask(known.target)
            if isinstance(decision, Open) and due.clock.now() + timedelta(seconds=decision.wait_s) <= deadline_of(
                due, known
            ):
                to_park[op_id] = _ToPark(known, decision, due)
                continue
            admissions.hold(op_id, decision)
        wanted = [op_id for op_id in dues if op_id not in to_park]
        return Passed(wanted, to_park, rung_due=bool(dues))

    def park(self, passed: Passed) -> dict[str, AttemptOutcome]:
        """Park what ``admit`` found waiting for its breaker (a concurrent claim or park wins).

        Best effort: this runs after the claim, so a park that fails (the ledger away) must not
        cut the doorbell's claims short; the operation it left stays due and is rung again.
        """
        parked: dict[str, AttemptOutcome] = {}
        for op_id, p in passed.to_park.items():
            try:
                wait = park_while_open_if_due(
                    self.sessions,
                    op_id,
                    p.action,
                    p.decision,
                    actor=self.worker_id,
                    spent_attempts=p.due.attempt_count,
                    now=p.due.clock.now(),
                )
            except Exception as exc:  # noqa: BLE001 - not parked: still due, rung again
                log.warning(
                    "breaker open, parking failed (%s): the operation stays due",
                    type(exc).__name__,
                    extra={"operation_id": op_id, "target": p.action.target},
                )
                continue
            if wait is not None:
                parked[op_id] = wait
        return parked

    def admit_taken_along(self, claims: Sequence[Claim], admissions: Admissions) -> None:
        """The operations the claim took along (not rung by this doorbell) have no breaker answer
        yet: each target is asked once, as for the rung ones, so a doorbell costs the breaker's
        Redis one admission per target, not one per call. Open or a probe: left unasked, so each
        call asks (and one of them probes)."""
        targets = [
            known.target
            for claim in claims
            if (known := self.actions.actions.get(claim.action)) is not None
            and not admissions.holds(claim.operation_id)
        ]
        admissions.share(targets)

    def checks(self, claims: Sequence[Claim]) -> SendChecks:
        overridden = self.authority.overridden(claims) if self.authority is not None else frozenset()
        return SendChecks(
            self.approvals(claims), self.objects(claims), self.evidence_down(claims), overridden=overridden
        )

    def evidence_down(self, claims: Sequence[Claim]) -> frozenset[str]:
        """The claims whose action requires evidence, if the separate evidence store is down: asked
        once per doorbell, and answered from what this process last saw of the store (a probe only
        when that is stale: outbox/evidence/health.py), never a round trip per operation."""
        sink = self.evidence
        if sink is None or not sink.separate:
            return frozenset()
        requiring = [c.operation_id for c in claims if self._requires_evidence(c.action)]
        if not requiring or sink.available():
            return frozenset()
        return frozenset(requiring)

    def _requires_evidence(self, action: str) -> bool:
        known = self.actions.actions.get(action)
        return known is not None and (known.evidence.required or self.evidence_required)

    def objects(self, claims: Sequence[Claim]) -> dict[str, Blocker]:
        """For the claims whose action declares a business object: take the object's hold, each in a
        transaction of its own committed before any send (so the next one on the object sees it), or
        name the operation that holds it back. None at all where no action declares an object."""
        held_back: dict[str, Blocker] = {}
        for claim in claims:
            known = self.actions.actions.get(claim.action)
            if known is None or known.business_object is None:
                continue
            with self.sessions.begin() as session:
                blocker = take_hold(session, claim.operation_id)
            if blocker is not None:
                held_back[claim.operation_id] = blocker
        return held_back

    def approvals(self, claims: Sequence[Claim]) -> dict[str, Grant | None]:
        """For the claims whose action needs approval for their arguments: the approval on record
        (one query; none at all where no action asks for approvals)."""
        needing = []
        for claim in claims:
            known = self.actions.actions.get(claim.action)
            if known is not None and known.approval.required != "never" and claim.args:
                if known.approval.applies(loads_exact(claim.args)):
                    needing.append(claim.operation_id)
        if not needing:
            return {}
        with self.sessions() as session:
            found = grants(session, needing)
        return {op_id: found.get(op_id) for op_id in needing}


def read_due_ops(ledger: LedgerConnection, operation_ids: Sequence[str]) -> dict[str, _Due]:
    with ledger.one_statement() as session:
        rows = read_due(session, operation_ids)
    dues = {}
    # Most budget left first: while a breaker is half-open, the first operation asked gets the
    # probe, so an outage's probes rotate even when a lagging relay rings several at once. Among
    # equals the oldest (the read has no order of its own).
    for row in sorted(rows, key=lambda r: (r.attempt_count, as_utc(r.created_at), r.id)):
        created, read_at = as_utc(row.created_at), as_utc(row.db_now)
        assert created is not None and read_at is not None
        dues[row.id] = _Due(
            row.action, created, as_utc(row.deadline_at), row.max_attempts, row.attempt_count, LedgerClock(read_at)
        )
    return dues


def park_while_open_if_due(
    sessions: sessionmaker[Session],
    operation_id: str,
    action: ActionConfig,
    decision: Open,
    *,
    actor: str,
    spent_attempts: int,
    now: datetime,
) -> RetryAt | None:
    """Breaker open: not sent, not claimed; the operation stays not_dispatched until the reopen time.

    No claim means no attempt row and no attempt number, so the wait costs no attempt budget (the
    deadline still applies: the caller checked it). Guarded like a claim: only a not_dispatched,
    due row moves, so a concurrent claim or park by another worker wins and we do nothing.
    """
    wait = breaker_wait(action, wait_s=decision.wait_s, now=now, spent_attempts=spent_attempts)
    failpoints.hit("gate.after_select_before_update")
    with sessions.begin() as session:
        if not park_for_breaker(session, operation_id, delay_s=wait.delay_s, reason=wait.why, actor=actor):
            return None
    log.info(
        "breaker open: parked for %.3fs",
        wait.delay_s,
        extra={"operation_id": operation_id, "target": action.target, "delay_s": wait.delay_s},
    )
    return wait
