"""Flower's stand-in for benchmarks: a process that takes in every Celery event of the outbox's
broker, as Flower's event receiver does (its own queue bound to the event exchange), and counts
them by type. With it, a worker's task events are delivered to a consumer, as where Flower runs,
not published to an exchange nobody listens to; its own CPU is counted apart (tests/loads/cpu_split.py).

    python -m bench.event_sink <ready-file> <counts-file>     # OUTBOX_* from the environment; SIGTERM ends it
"""

from __future__ import annotations

import collections
import json
import signal
import sys
from pathlib import Path
from typing import Any

from celery.events.receiver import EventReceiver


class _Receiver(EventReceiver):  # type: ignore[misc]
    ready_file: Path

    def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
        super().on_consume_ready(*args, **kwargs)
        self.ready_file.write_text("ready")  # its queue is bound: every event from now on reaches it


def main(argv: list[str]) -> int:
    from workers.wiring.celery_app import make_app

    ready, out = Path(argv[0]), Path(argv[1])
    app = make_app()
    counts: collections.Counter[str] = collections.Counter()
    with app.connection() as connection:
        receiver = _Receiver(connection, handlers={"*": lambda event: counts.update([event["type"]])}, app=app)
        receiver.ready_file = ready
        signal.signal(signal.SIGTERM, lambda *_: setattr(receiver, "should_stop", True))
        receiver.capture(limit=None, timeout=None, wakeup=False)
    out.write_text(json.dumps(dict(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
