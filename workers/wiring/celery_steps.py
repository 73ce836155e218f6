"""Celery's side of the heartbeat (heartbeat.py): a consumer step for workers, a scheduler for beat."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.beat import PersistentScheduler

from workers.ground.heartbeat import EVERY_S, Heartbeat


class WorkerHeartbeat(bootsteps.StartStopStep):  # type: ignore[misc]
    """A Celery consumer step: beat every EVERY_S from the consumer's timer."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.heartbeat = Heartbeat.from_env(every_s=0.0)
        self.entry: Any = None

    def start(self, parent: Any) -> None:
        if self.heartbeat.path is not None:
            self.heartbeat.beat()
            self.entry = parent.timer.call_repeatedly(EVERY_S, self.heartbeat.beat)

    def stop(self, parent: Any) -> None:
        if self.entry is not None:
            self.entry.cancel()
            self.entry = None


class BeatScheduler(PersistentScheduler):  # type: ignore[misc]
    """Celery beat's own scheduler (a shelve file, as by default), beating at every tick."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.heartbeat = Heartbeat.from_env(every_s=0.0)
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self.heartbeat.beat()
        return float(super().tick(*args, **kwargs))
