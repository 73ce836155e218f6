"""The Redis transport the Celery app installs (workers/wiring/broker_transport.py), against a real Redis.

kombu's own transport answers a request on a channel whose connection was collected with
``AttributeError: 'NoneType' object has no attribute 'hostname'`` (celery/kombu#582, #970), which no
connection-error handler catches: under load that stopped a prefork worker on a broker restart
(tests/faults/test_broker_outage.py kills Redis for real). Ours answers with a connection error.
"""

from __future__ import annotations

from pathlib import Path

import kombu
import pytest
import redis.exceptions

from outbox.settings import Settings
from workers.wiring import broker_transport
from workers.wiring.celery_app import make_app

pytestmark = [pytest.mark.redis]


def test_the_app_makes_redis_urls_use_the_transport_and_still_shows_them_as_redis(redis_url: str, tmp_path: Path):
    app = make_app(Settings(broker_url=redis_url, data_dir=tmp_path))
    with app.connection_for_write() as conn:
        assert type(conn.transport) is broker_transport.Transport
        assert conn.as_uri().startswith("redis://")  # the banner, "Connected to ...", Flower


def test_a_channel_of_a_collected_connection_reports_a_lost_connection(redis_url: str):
    broker_transport.install()
    conn = kombu.Connection(redis_url)
    channel = conn.default_channel  # connected
    # As Celery's consumer does on a connection loss, before it closes the connection.
    conn.collect()
    with pytest.raises(redis.exceptions.ConnectionError, match="the broker connection was closed"):
        with channel.conn_or_acquire():
            pass
    assert isinstance(redis.exceptions.ConnectionError(), conn.connection_errors)  # what kombu ignores on close
    conn.close()
