"""Which soft-limit signals a pool process acts on (workers/wiring/soft_limit.py).

tests/faults/test_stale_soft_limit.py sends the signals to real prefork workers.
"""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler

from workers.wiring import soft_limit
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
    assert g.stale() == "no task is running"
    g.on_signal(10, None)  # ignored: no exception
    g.task_started(2.0)
    g.task_ended()
    assert g.stale() == "no task is running"


def test_a_signal_early_in_a_later_task_is_stale_and_late_in_it_is_not():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 0.5  # far from its limit: the signal was armed for another task
    assert g.stale() == "the running task began 0.50s ago and its soft limit is 2s"
    w.now += 1.4  # 1.9 s: within the share left for the gap between the ACK and task_prerun
    assert g.stale() is None


def test_a_leaving_process_ignores_every_signal():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 5.0
    w.leaving = True
    assert g.stale() == "the process is leaving (Celery stopped it)"
    g.on_signal(10, None)


def test_a_task_with_no_known_limit_honours_the_signal():
    g = World().guard()
    g.task_started(None)
    with pytest.raises(SoftTimeLimitExceeded):
        g.on_signal(10, None)


def test_a_task_run_eagerly_inside_another_keeps_the_outer_one_timed():
    w = World()
    g = w.guard()
    g.task_started(2.0)
    w.now += 1.0
    g.task_started(2.0)  # .apply() inside the task: its own prerun and postrun
    g.task_ended()
    w.now += 1.0
    assert g.stale() is None  # the outer task, 2 s in


def test_an_ignored_signal_is_said_later_not_in_the_handler(caplog):
    g = World().guard()
    with caplog.at_level(logging.INFO, logger="workers.wiring.soft_limit"):
        g.on_signal(10, None)
        assert caplog.records == []
        g.say_ignored()
    assert [r.getMessage() for r in caplog.records] == [
        "soft time limit signal ignored, armed for a task that has ended: no task is running"
    ]


def test_prerun_puts_the_guard_in_billiards_place_and_leaves_other_handlers_alone():
    before = signal.getsignal(SIG_SOFT_TIMEOUT)
    task = SimpleNamespace(request=SimpleNamespace(timelimit=None), soft_time_limit=None)
    task.app = SimpleNamespace(conf=SimpleNamespace(task_soft_time_limit=30))
    try:
        signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)  # a pool process, before its first task
        soft_limit.on_task_prerun(task=task)
        assert signal.getsignal(SIG_SOFT_TIMEOUT) == soft_limit._guard.on_signal
        soft_limit.on_task_postrun()
        soft_limit.on_task_prerun(task=task)  # the next task: still the guard's
        assert signal.getsignal(SIG_SOFT_TIMEOUT) == soft_limit._guard.on_signal
        soft_limit.on_task_postrun()

        def celerys_own(signum: int, frame: object) -> None: ...

        signal.signal(SIG_SOFT_TIMEOUT, celerys_own)  # solo: Celery's SIGUSR1 handler stays
        soft_limit.on_task_prerun(task=task)
        assert signal.getsignal(SIG_SOFT_TIMEOUT) is celerys_own
    finally:
        signal.signal(SIG_SOFT_TIMEOUT, before)


def test_the_limit_is_the_messages_then_the_tasks_then_the_apps():
    app = SimpleNamespace(conf=SimpleNamespace(task_soft_time_limit=30))
    task = SimpleNamespace(request=SimpleNamespace(timelimit=(20, 10)), soft_time_limit=15, app=app)
    assert soft_limit._soft_limit_of(task) == 10
    task.request.timelimit = None
    assert soft_limit._soft_limit_of(task) == 15
    task.soft_time_limit = None
    assert soft_limit._soft_limit_of(task) == 30
