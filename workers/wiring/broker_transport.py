"""kombu's Redis transport, with channels that know when their connection was closed.

When Redis goes away under a prefork worker, Celery's consumer collects the broken connection
(``Connection.collect``: the transport forgets its client) and then closes it. Closing the default
channel restores its unacknowledged messages, which needs a Redis client; the channel's pool was
already dropped, so it builds a new one from connection parameters that are no longer there, and
kombu raises ``AttributeError: 'NoneType' object has no attribute 'hostname'`` (celery/kombu#582,
#970). No connection-error handler expects an AttributeError, so it escapes: the worker's main
process stops ("Unrecoverable error", CRITICAL), and the hub, closing, runs the pending
acknowledgements of tasks that finished meanwhile on the same dead channel ("Error on stopping
Hub", ERROR). It happens only when the outage catches tasks in flight, which is why it came and
went between runs under the same load.

Here such a channel raises what it would have met had it tried: a Redis ConnectionError. kombu
and Celery treat that as what it is, a lost connection: the close is ignored, the consumer
reconnects, an acknowledgement that cannot be sent is logged as such (workers/wiring/broker_outage.py
says how loudly). Nothing else changes. A message left unacknowledged is redelivered by Redis after
the visibility timeout, or is gone with a restarted Redis and rung again by the relay; either way
the ledger decides, and a duplicate doorbell finds nothing to claim.
"""

from __future__ import annotations

from typing import Any

import kombu.transport
import redis.exceptions
from kombu.transport import redis as kombu_redis

# The URL schemes that name kombu's Redis transport (kombu.transport.TRANSPORT_ALIASES).
REDIS_SCHEMES = ("redis", "rediss")


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None or self.connection.client is None:
            # The channel was closed, or its Connection was (close() or collect()): there is
            # nothing left to connect with.
            raise redis.exceptions.ConnectionError("the broker connection was closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Make ``redis://`` and ``rediss://`` broker URLs use this transport in this process.

    Through kombu's table of URL schemes rather than Celery's ``broker_transport`` setting: with a
    class path there, kombu would print the path instead of ``redis://`` wherever it shows the
    broker's URL (the worker banner, "Connected to ...", Flower).
    """
    path = f"{__name__}:Transport"
    for scheme in REDIS_SCHEMES:
        kombu.transport.TRANSPORT_ALIASES[scheme] = path
        # A connection made before this call resolved (and cached) the stock class.
        kombu.transport._transport_cache.pop(scheme, None)
