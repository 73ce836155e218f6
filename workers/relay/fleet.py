"""The relays of a fleet draining several ledgers (OUTBOX_DATABASE_URLS): one Relay per ledger, each
in its own thread, with its own engine, LISTEN connection, ticks and doorbell queue.

So a ledger that is down stops only its own relay's ticks (its OutageReport says so, once), and a
backlog in one ledger fills only its own queue: each relay counts and bounds the doorbells of its
ledger (OUTBOX_RELAY_MAX_QUEUED each), and a worker consumes every ledger's queue in turn.
"""

from __future__ import annotations

import logging
import threading

from workers.relay.loop import Relay, Tick

log = logging.getLogger(__name__)


class RelayGroup:
    """Several relays run as one (``run_forever``, ``stop``, ``run_once``: a Relay's own). If one
    relay's loop dies (a bug: outages are ridden out inside it), the whole group stops and
    ``run_forever`` raises, as a lone relay's would: the process ends and its supervisor restarts
    it, instead of running on with one ledger's relay silently gone."""

    def __init__(self, relays: list[Relay]) -> None:
        self.relays = relays
        self.failed: BaseException | None = None

    def run_forever(self) -> None:
        threads = [
            threading.Thread(target=self._run_one, args=(relay,), name=f"relay-{i}", daemon=True)
            for i, relay in enumerate(self.relays)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self.failed is not None:
            raise RuntimeError("a relay of the group stopped; the others were stopped with it") from self.failed

    def _run_one(self, relay: Relay) -> None:
        try:
            relay.run_forever()
        except BaseException as exc:
            log.exception("%s stopped; stopping every ledger's relay", relay.name)
            self.failed = exc
            self.stop()

    def stop(self) -> None:
        for relay in self.relays:
            relay.stop()

    def run_once(self) -> Tick:
        """One tick of each relay, summed (a ledger that is down raises: ``relay --once`` says which)."""
        ticks = [relay.run_once() for relay in self.relays]
        return Tick(*(sum(getattr(t, f) for t in ticks) for f in ("expired", "dispatch", "reconcile")))
