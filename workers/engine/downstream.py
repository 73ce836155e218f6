"""The downstream: what calling a provider (a dispatch attempt or a reconciler's lookup) takes, and
the pacing of each call to its target's declared limits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.claims import Claim
from workers.engine.authority import Authority
from workers.pacing import Cleared, Deferred, Pacer
from workers.provider.actions import ActionsFile
from workers.provider.connectors import ConnectorSet

# A call waits for a limit in its thread only while its lease still covers the call (its timeouts)
# and this much more for the finalize after it.
FINALIZE_MARGIN_S = 0.5


@dataclass(frozen=True)
class Downstream:
    """What calling a provider takes: the actions file (targets, budgets), the connectors, the
    pacer that holds each call to its target's declared limits (None: no limits anywhere), and the
    ledger's sessions for a retry's charge to its conversation (None: nothing is charged)."""

    actions: ActionsFile
    connectors: ConnectorSet
    pacer: Pacer | None = None
    # Who may still act (workers/engine/authority.py), asked before each send; None: nobody is asked.
    authority: Authority | None = None
    sessions: sessionmaker[Session] | None = None

    def pace(self, claim: Claim, target: str, *, deadline: datetime | None = None) -> Cleared | Deferred:
        """Whether this claimed call (or lookup) may leave now, after a short wait in this thread
        within its lease and ``deadline``, or must go back to the ledger. No limits declared: at once."""
        if self.pacer is None or target not in self.pacer.limits:
            return Cleared(target)
        cfg = self.actions.targets[target]
        now = claim.now()
        lease_left = (claim.lease_expires_at - now).total_seconds() - cfg.timeout_s - cfg.connect_timeout_s
        may_wait = lease_left - FINALIZE_MARGIN_S
        if deadline is not None:
            may_wait = min(may_wait, (deadline - now).total_seconds())
        return self.pacer.clear(target, claim.tenant, max_wait_s=max(0.0, may_wait))

    def done(self, cleared: Cleared) -> None:
        if self.pacer is not None:
            self.pacer.done(cleared)


def addressed(claim: Claim) -> dict[str, Any]:
    """What every request about a claimed operation carries beside its arguments, a call or a
    lookup alike: the key the provider sees, the tenant and the fencing token."""
    return {"idempotency_key": claim.provider_key, "tenant": claim.tenant, "fencing_token": claim.fencing_token}
