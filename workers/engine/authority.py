"""Authority at the send: a claimed intent leaves only while the authority it came with is in force.

Asked right before each call (fan_out.py), from this process's snapshot of who may no longer act
(outbox/ledger/authority.py: at most a second old, read again here when older), so nothing is added
to the hot path but a dictionary lookup:

- its submitting key was revoked: not sent. An earlier attempt that may still land is looked up
  (outcome_unknown), never stranded; a revocation that says so (``--cancel-queued``) cancels it;
  otherwise a person decides (reconciliation_required, waiting_for = authority). A person who resolved
  it "not executed" after the revocation decided in their own name (``overridden``): it is sent;
- its subject is stopped: held (not_dispatched, waiting_for = stopped), the attempt not counted. The
  hold is written under the stop's row lock (``hold_if_stopped``): a resume in between makes it due at
  once instead of leaving it held;
- its approval was given with a key revoked since: it no longer counts (``approval_lapse``), back to
  awaiting_approval for a new one;
- who may act cannot be read (the ledger away for longer than TRUST_S): nothing is sent, tried again soon.

Lookups are never asked: a lookup reads what may have happened and settles it (an unknown is never
stranded); nothing it does is sent in anyone's name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from outbox.access.revocation import decided_after
from outbox.approvals.decisions import Grant
from outbox.ledger.authority import AuthorityBoard, Revocation, Snapshot, read_snapshot
from outbox.ledger.claims import Claim
from outbox.ledger.states import Status, WaitingFor
from outbox.ledger.stops import HOLD_S, held_reason, still_stopped
from outbox.ledger.transitions import AttemptReport, finalize_if_fenced
from workers.engine.outcomes import Ambiguous, AttemptOutcome, Cancelled, NeedsPerson, RetryAt

log = logging.getLogger(__name__)

# Who may act could not be read: nothing is sent, and the operation is looked at again this soon.
UNREADABLE_RETRY_S = 1.0


@dataclass(frozen=True)
class Authority:
    """This process's view of one ledger's authority: its sessions (to read it again) and its board."""

    sessions: sessionmaker[Session]
    board: AuthorityBoard

    def snapshot(self) -> Snapshot:
        """Raises when it cannot be read and the last reading is too old to act on."""

        def read() -> Snapshot:
            with self.sessions() as session:
                return read_snapshot(session)

        return self.board.current(read)

    def overridden(self, claims: Sequence[Claim]) -> frozenset[str]:
        """The claims whose submitting key was revoked and whom a person resolved "not executed" since
        (one query; none while no claim's key is revoked)."""
        try:
            snap = self.snapshot()
        except Exception:  # noqa: BLE001 - the send fails closed on its own check
            return frozenset()
        asked = [(c.operation_id, r.at) for c in claims if (r := snap.revocation_of(c.submitted_by)) is not None]
        if not asked:
            return frozenset()
        with self.sessions() as session:
            return frozenset(decided_after(session, asked))


def refusal(authority: Authority | None, claim: Claim, *, overridden: bool = False) -> AttemptOutcome | None:
    """Why this claim must not be sent now (None: it may)."""
    if authority is None:
        return None
    try:
        snap = authority.snapshot()
    except Exception as exc:  # noqa: BLE001 - fail closed: nothing leaves on authority we cannot read
        log.warning("who may act cannot be read (%s): not sent", type(exc).__name__, extra=claim.log_fields())
        why = f"who may act could not be read ({type(exc).__name__}): not sent; looked at again shortly"
        return RetryAt(UNREADABLE_RETRY_S, why, refund_attempt=True, waiting_for=WaitingFor.AUTHORITY)
    revoked = snap.revocation_of(claim.submitted_by)
    if revoked is not None and not overridden:
        return revoked_submitter(claim, revoked)
    stop = snap.stop_of(claim.tenant, claim.subject)
    if stop is not None:
        return RetryAt(HOLD_S, held_reason(stop), refund_attempt=True, waiting_for=WaitingFor.STOPPED)
    return None


def revoked_submitter(claim: Claim, revoked: Revocation) -> AttemptOutcome:
    """Its submitting key was revoked: nothing more is sent in its name."""
    said = revoked.describe()
    if claim.open_ambiguity:
        return Ambiguous(f"{said}: not sent again; an earlier attempt may have taken effect: looking it up")
    if revoked.cancels_queued:
        return Cancelled(f"cancelled: {said} with --cancel-queued; nothing was sent")
    return NeedsPerson(
        f"{said}; nothing was sent since, and nothing more is sent in its name: a person decides",
        WaitingFor.AUTHORITY,
    )


def approval_lapse(authority: Authority | None, grant: Grant | None) -> str | None:
    """Why an approval on record no longer counts because the key that gave it was revoked (None: it counts)."""
    if authority is None or grant is None or grant.approver_identity is None:
        return None
    try:
        revoked = authority.snapshot().revocation_of(grant.approver_identity)
    except Exception:  # noqa: BLE001 - refusal() has failed closed already
        return None
    if revoked is None:
        return None
    return (
        f"approval {grant.approval_id} by {grant.approver} was given with {grant.approver_identity}, revoked at "
        f"{revoked.at.isoformat(timespec='seconds')}: it no longer counts; a new approval is needed"
    )


def is_hold(outcome: AttemptOutcome) -> bool:
    """A hold for a stopped subject (written alone, under the stop's lock: ``hold_if_stopped``)."""
    return isinstance(outcome, RetryAt) and outcome.waiting_for is WaitingFor.STOPPED


def hold_if_stopped(session: Session, claim: Claim, report: AttemptReport) -> bool:
    """Hold the claimed operation while its subject is still stopped (the stop's row share-locked until
    the caller commits); False, with nothing written, when it was resumed meanwhile."""
    stop = still_stopped(session, claim.tenant, claim.subject)
    if stop is None:
        return False
    finalize_if_fenced(
        session,
        claim,
        report,
        to=Status.NOT_DISPATCHED,
        reason=held_reason(stop),
        delay_s=HOLD_S,
        refund_attempt=True,
        waiting_for=WaitingFor.STOPPED,
    )
    return True
