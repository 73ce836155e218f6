"""The long-poll behind ``GET /v1/operations/{id}/wait``: one shared poller per server process.

Waiting requests register their operation id and sleep on an event; one background task asks
which waited-for operations are settled (final, or waiting for a person) in ONE query per tick
(outbox.service.waiting.settled, the read every waiter makes) and wakes them. A hundred waiting
requests cost one query per tick, not a hundred loops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

from sqlalchemy.orm import Session, sessionmaker

from outbox.service.waiting import POLL_S, settled


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

    def _settled(self, ids: list[str]) -> set[str]:
        with self._sessions() as session:
            return settled(session, ids)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
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
