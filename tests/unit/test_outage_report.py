"""What a loop retrying through an outage logs (workers/ground/outage.py OutageReport): one WARNING."""

from __future__ import annotations

import logging

import pytest
import redis.exceptions

from workers.ground.outage import OutageReport

REFUSED = redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_one_warning_then_info_and_its_end_is_said_once_quiet(caplog: pytest.LogCaptureFixture):
    clock = Clock()
    report = OutageReport(logging.getLogger("test.relay"), "relay", quiet_s=5.0, clock=clock)
    caplog.set_level(logging.INFO, logger="test.relay")
    for _ in range(3):
        report.failed(REFUSED, "relay could not publish %d notified doorbell(s)", 3)
        clock.now += 1.0
    report.succeeded()  # 1 s after the last failure: a tick with nothing to publish proves nothing
    clock.now += 4.0
    report.succeeded()
    report.succeeded()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "relay could not publish 3 notified doorbell(s)"),
        ("INFO", f"relay could not publish 3 notified doorbell(s) (ConnectionError: {REFUSED})"),
        ("INFO", f"relay could not publish 3 notified doorbell(s) (ConnectionError: {REFUSED})"),
        ("INFO", "relay: outage over (attempts failed for 2.0s, 3 in all)"),
    ]
    assert caplog.records[0].exc_info is not None and caplog.records[1].exc_info is None
    # The next outage warns again.
    report.failed(REFUSED, "relay tick failed; retrying")
    assert caplog.records[-1].levelname == "WARNING"
