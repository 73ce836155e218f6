"""Which soft-limit signals a pool process acts on (workers/wiring/soft_limit.py).

tests/faults/test_stale_soft_limit.py sends the signals to real prefork workers.
"""

from __future__ import annotations

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from workers.wiring.soft_limit import SoftLimitGuard


class World:
    def __init__(self) -> None:
        self.now = 100.0
        self.leaving = False

    def guard(self) -> SoftLimitGuard:
        return SoftLimitGuard(lambda: self.leaving, clock=lambda: self.now)


def test_the_signal_of_the_running_task_past_its_limit_raises():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 2.0
    assert g.stale() is None
    with pytest.raises(SoftTimeLimitExceeded):
        g.on_signal(10, None)


def test_a_signal_with_no_task_running_is_stale():
    g = World().guard()
    assert g.stale() == "no task running"
    g.on_signal(10, None)  # ignored: no exception
    g.task_started(2.0)
    g.task_ended()
    assert g.stale() == "no task running"


def test_a_signal_early_in_a_later_task_is_stale_and_late_in_it_is_not():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 0.5  # the parent's timer starts after the task began here: this one was another's
    assert g.stale() == "the running task began 0.50s ago, its soft limit is 2s"
    w.now += 1.4  # 1.9 s: within the share left for the parent's timer firing early
    assert g.stale() is None


def test_a_leaving_process_ignores_every_signal():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 5.0
    w.leaving = True
    assert g.stale() == "the process is leaving (its task was stopped)"
    g.on_signal(10, None)


def test_a_task_with_no_known_limit_honours_the_signal():
    g = World().guard()
    g.task_started(None)
    with pytest.raises(SoftTimeLimitExceeded):
        g.on_signal(10, None)
