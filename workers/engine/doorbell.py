"""The doorbell: a broker message that says only "operation X may be due".

It carries the operation id and nothing else (no arguments, no keys: Flower and the broker never
see business data). Losing one is harmless (the relay re-publishes after republish_after_s);
ringing twice is harmless (the second finds nothing to claim).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from celery import Celery
from sqlalchemy import Engine

from outbox.evidence.rechecks import due_rechecks
from outbox.ledger import tracing
from workers.engine.queues import DISPATCH_QUEUE, DISPATCH_TASK, RECONCILE_TASK, UNKNOWN_QUEUE, ledger_queue
from workers.ground.outage import BROKER_OUTAGES

log = logging.getLogger(__name__)


@dataclass
class Doorbell:
    app: Celery
    # Doorbells carry up to this many ids. Dispatch: one message, one claim statement and one
    # finalize transaction serve them all. Reconcile: one message and one late-evidence check
    # serve them all, each then looked up in turn (a task per id would cost the reconciler a
    # Celery message, a late-evidence check and a claim per operation).
    batch: int = 1
    # The stored traceparents of some operation ids (outbox.ledger.publish.traceparents), for the
    # publish span; read only while tracing is on. None: publish spans stand alone.
    traces: Callable[[list[str]], dict[str, str]] | None = None
    # The ledger these operations live in, for a fleet draining several (OUTBOX_DATABASE_URLS): its
    # doorbells travel on its own queues and name it (the task's ``ledger``). None: the one ledger.
    ledger: str | None = None

    def ring_dispatch(self, operation_ids: Iterable[str]) -> int:
        return self._ring(DISPATCH_TASK, ledger_queue(DISPATCH_QUEUE, self.ledger), list(operation_ids), self.batch)

    def ring_dispatch_after_commit(self, operation_ids: Iterable[str]) -> None:
        """Ring for operations a committed transaction made due again (a retry without backoff, a
        lookup's "send again"). The commit is what counts: with the broker away, the relay
        re-publishes them after republish_after_s, so the outage (which Celery's consumer and the
        relay report, once each) costs them that wait and neither a WARNING of their own nor an
        exception that would make the caller think its transaction failed."""
        ids = list(operation_ids)
        try:
            self.ring_dispatch(ids)
        except BROKER_OUTAGES as exc:
            log.info(
                "doorbell for %d operation(s) not rung (%s): the relay re-publishes them",
                len(ids),
                type(exc).__name__,
                extra={"operation_ids": ids},
            )

    def ring_reconcile(self, operation_ids: Iterable[str]) -> int:
        return self._ring(RECONCILE_TASK, ledger_queue(UNKNOWN_QUEUE, self.ledger), list(operation_ids), self.batch)

    def ring_rechecks(self, engine: Engine) -> list[str]:
        """Handoffs whose next check is due (outbox/evidence/rechecks.py): any reconcile doorbell with
        room left takes them along, so one is rung only when the broker holds none (the relay's sweep
        rings it: re-checks are hours apart)."""
        if self.queued_reconcile():
            return []
        ids = due_rechecks(engine, limit=self.batch)
        if ids:
            self.ring_reconcile(ids)
        return ids

    def queued_dispatch(self) -> int | None:
        """Dispatch doorbells waiting in the broker (not those a worker holds), or None if unknown."""
        return self._queued(ledger_queue(DISPATCH_QUEUE, self.ledger))

    def queued_reconcile(self) -> int | None:
        """Reconcile doorbells waiting in the broker (not those a reconciler holds), or None if unknown."""
        return self._queued(ledger_queue(UNKNOWN_QUEUE, self.ledger))

    def _queued(self, queue: str) -> int | None:
        """kombu's passive queue_declare would say this, but with a global_keyprefix its existence
        check looks at the unprefixed key and answers NOT_FOUND; the channel's own size query (a
        LLEN per priority on Redis, a COUNT on the embedded broker) is what it would have called."""
        try:
            with self.app.connection_or_acquire() as conn:
                return int(conn.default_channel._size(queue))
        except Exception:  # noqa: BLE001 - unknown depth: the relay publishes without a bound
            log.debug("could not read the depth of queue %s", queue, exc_info=True)
            return None

    def _ring(self, task: str, queue: str, operation_ids: list[str], batch: int) -> int:
        """Publish; returns the number of messages. A message's argument is one id or a list."""
        chunks = [operation_ids[i : i + batch] for i in range(0, len(operation_ids), max(batch, 1))]
        traced = tracing.enabled() and self.traces is not None
        known = self.traces(operation_ids) if traced and self.traces is not None else {}
        # Only a fleet's doorbells name their ledger: the one ledger's look as they always did.
        kwargs = {"ledger": self.ledger} if self.ledger is not None else None
        kwargs_shown = _shown(kwargs or {})
        with self.app.producer_or_acquire() as producer:

            def send(arg: str | list[str]) -> None:
                self.app.send_task(
                    task,
                    args=[arg],
                    kwargs=kwargs,
                    queue=queue,
                    producer=producer,
                    argsrepr=_shown([arg]),
                    kwargsrepr=kwargs_shown,
                )

            for chunk in chunks:
                arg: str | list[str] = chunk[0] if len(chunk) == 1 else chunk
                if not traced:
                    send(arg)
                    continue
                # One operation: a span of its trace; several: a span of its own, linked to each.
                mine = [known[i] for i in chunk if i in known]
                parent = mine[0] if len(chunk) == 1 and mine else None
                attributes = {"messaging.destination.name": queue, "outbox.operations": len(chunk)}
                with tracing.span(
                    "outbox.relay.publish", parent=parent, links=[] if parent else mine, attributes=attributes
                ):
                    send(arg)
        return len(chunks)


# Celery writes each message's arguments as text for Flower and the worker's log, through saferepr
# unless given: ids and a ledger's name need none of its care, and it costs the relay a sizeable part
# of a publish. Cut at Celery's own length for that text.
_SHOWN_MAX = 1024


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."
