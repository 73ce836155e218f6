"""A claimed operation answered by a webhook event the ledger already holds, instead of a lookup.

A success event can come before its operation could take it (outbox/evidence/stored_events.py: it named
the operation by a reference the 202's finalize had not recorded yet). The provider got its 200 and
will not send it again; the reconciler takes it up when it claims the operation: one read per claim
batch (only when some claimed action maps webhooks), and such an operation is settled succeeded as a
lookup that found it done would be (the same fenced settlement, the evidence written with it), the
event marked as its own (``Asked.events``). Nothing is asked of the provider for it, so it settles even
while the provider's lookups are down or its breaker is open.

Not taken up: an event that came to the target's own endpoint for a walled tenant (an account or a
secret of its own), events that name several references (the lookup decides), and actions whose
``webhooks.match`` compares the event's object (the ledger does not keep the object to compare it).
Failure events are never settled without the lookup reading the provider's object.
"""

from __future__ import annotations

from collections.abc import Sequence

from outbox.evidence.stored_events import StoredSuccess, successes_for
from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass, Status
from workers.engine.committer import Committer
from workers.provider.actions import ActionConfig
from workers.reconcile.judge import LookupVerdict
from workers.reconcile.lookup import Asked


def answered_by_events(rec: Committer, claims: Sequence[Claim]) -> list[Asked]:
    """The claims a stored success event answers (settled without a lookup), each with its event rows."""
    mapped: dict[str, tuple[Claim, ActionConfig]] = {}
    for claim in claims:
        action = rec.actions.actions.get(claim.action)
        if action is not None and action.webhooks is not None and not action.webhooks.match:
            mapped[claim.operation_id] = (claim, action)
    if not mapped:
        return []
    with rec.sessions() as session:
        stored = successes_for(session, list(mapped))
    by_op: dict[str, list[StoredSuccess]] = {}
    for event in stored:
        by_op.setdefault(event.operation_id, []).append(event)
    answered = []
    for op_id, events in by_op.items():
        claim, action = mapped[op_id]
        walled = rec.actions.targets[action.target].walled_tenants
        ours = [
            e
            for e in events
            if e.target == action.target and (e.scope == claim.tenant or (e.scope == "" and claim.tenant not in walled))
        ]
        if not ours or None in {e.reference for e in ours} or len({e.reference for e in ours}) > 1:
            continue  # no reference to record, or several: the lookup decides
        first = ours[0]
        reason = (
            f"webhook {first.event_type} ({first.event_id}) from {first.target}, kept at "
            f"{first.received_at:%Y-%m-%dT%H:%M:%S} before its operation could take it, confirmed it"
        )
        verdict = LookupVerdict(Status.SUCCEEDED, AttemptClass.SUCCEEDED, reason, reference=first.reference)
        answered.append(Asked(claim, action, early=verdict, events=tuple(e.row_id for e in ours)))
    return answered
