"""The long-poll behind ``GET /v1/operations/{id}/wait``: one shared poller per server process.

Waiting requests register their operation id and sleep on an event; one background task reads
the status of every waited-for operation in ONE query per tick and wakes those whose outcome is
settled (final, or waiting for a person). A hundred waiting requests cost one query per tick, not
a hundred loops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.models import Operation
from outbox.reads.typed_outcome import SETTLED, outcome_of

TICK_S = 0.2


class Waiters:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self, operation_id: str, timeout_s: float) -> None:
        """Return when the operation's outcome is settled, or after ``timeout_s``."""
        event = asyncio.Event()
        self._events[operation_id].add(event)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout_s)
        finally:
            waiting = self._events.get(operation_id)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    self._events.pop(operation_id, None)

    def _settled(self, ids: list[str]) -> list[str]:
        with self._sessions() as session:
            rows = session.execute(select(Operation.id, Operation.status).where(Operation.id.in_(ids))).all()
        return [r.id for r in rows if outcome_of(r.status) in SETTLED]

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            ids = list(self._events)
            if not ids:
                continue
            try:
                settled = await asyncio.to_thread(self._settled, ids)
            except Exception:  # noqa: BLE001 - a ledger blip: waiters keep waiting until their timeout
                continue
            for op_id in settled:
                for event in self._events.get(op_id, ()):
                    event.set()
