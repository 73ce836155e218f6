"""The doorbells' queues and task names: what the relay and the commit step ring, and what the Celery
app routes and consumes (workers/wiring/celery_app.py)."""

from __future__ import annotations

DISPATCH_QUEUE = "dispatch"
UNKNOWN_QUEUE = "outcome_unknown"
DISPATCH_TASK = "outbox.dispatch"
RECONCILE_TASK = "outbox.reconcile"


def ledger_queue(kind: str, ledger: str | None) -> str:
    """The queue of ``kind`` (DISPATCH_QUEUE or UNKNOWN_QUEUE) for one ledger of a fleet draining
    several (OUTBOX_DATABASE_URLS): ``dispatch.<name>``; the plain queue for the one ledger. Each
    ledger has its own, so the relay of each counts and bounds only its own doorbells (a backlog in
    one ledger cannot take another's place in the broker) and a worker takes from each in turn."""
    return kind if ledger is None else f"{kind}.{ledger}"
