"""Waiting for a settled outcome: final, or waiting for a person (outbox.ledger.typed_outcome.SETTLED).

One read answers every waiter: which of these operations are settled, in one query whatever their
number. The HTTP API's shared long-poll (producer/http/waiters.py) asks it once per tick for all its
waiting requests; an agent tool's wait (producer/agents/calls.py, and the MCP server's
wait_operation on its event loop) asks it for one operation until its deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import InvalidIntent
from outbox.ledger.models import Operation
from outbox.ledger.typed_outcome import SETTLED, outcome_of

# A waiter holds a request (or a tool call) open: a minute stays within common proxies' idle
# timeouts (nginx and AWS load balancers default to 60 s); a caller that needs longer waits again.
MAX_WAIT_S = 60.0
# How often a waiter re-reads: an outcome is seen within 0.2 s of being settled; the HTTP API's
# poller makes that one query per tick for all its waiting requests.
POLL_S = 0.2


def timeout_of(value: Any) -> float:
    """A waiter's ``timeout_s``, or InvalidIntent: a number from 0 to MAX_WAIT_S."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_WAIT_S:
        raise InvalidIntent("timeout_s", f"must be a number from 0 to {MAX_WAIT_S:g}")
    return float(value)


def settled(session: Session, operation_ids: Collection[str]) -> set[str]:
    """Those of ``operation_ids`` whose outcome is settled (the one read every waiter makes)."""
    if not operation_ids:
        return set()
    rows = session.execute(select(Operation.id, Operation.status).where(Operation.id.in_(list(operation_ids)))).all()
    return {r.id for r in rows if outcome_of(r.status) in SETTLED}


def _settled_one(sessions: sessionmaker[Session], operation_id: str) -> bool:
    with sessions() as session:
        return operation_id in settled(session, [operation_id])


def wait(
    sessions: sessionmaker[Session],
    operation_id: str,
    *,
    timeout_s: float,
    poll_s: float = POLL_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Until the operation's outcome is settled (True) or ``timeout_s`` passed (False), on this thread."""
    deadline = clock() + timeout_of(timeout_s)
    while not _settled_one(sessions, operation_id):
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(poll_s, left))
    return True


async def wait_async(
    sessions: sessionmaker[Session], operation_id: str, *, timeout_s: float, poll_s: float = POLL_S
) -> bool:
    """As ``wait``, on an event loop: a thread is held only for each read, never for the wait (a
    long wait must not take a thread that other calls and other tenants need)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_of(timeout_s)
    while not await asyncio.to_thread(_settled_one, sessions, operation_id):
        left = deadline - loop.time()
        if left <= 0:
            return False
        await asyncio.sleep(min(poll_s, left))
    return True
