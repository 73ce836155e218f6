"""The relay's gathering of notified ids into doorbells (workers/relay/gather.py), on a given clock."""

from __future__ import annotations

from workers.relay.gather import Gather


def _gather(busy: list[bool]) -> Gather:
    return Gather(batch=10, linger_s=0.01, busy_linger_s=0.1, recheck_s=0.05, busy=lambda: busy[0])


def test_while_a_worker_is_free_an_id_goes_at_once_after_a_quiet_linger_window():
    g = _gather([False])
    g.add(["a"], now=1.0)
    assert g.hold_s(1.0) <= 0
    assert g.take(1.0) == ["a"]
    g.add(["b"], now=1.002)  # within the linger window of the last publish: waits for its end
    assert 0 < g.hold_s(1.002) <= 0.008 + 1e-9
    assert g.hold_s(1.011) <= 0


def test_while_every_worker_is_busy_ids_wait_for_a_full_doorbell_or_the_busy_linger():
    busy = [True]
    g = _gather(busy)
    g.add(["a"], now=1.0)
    assert g.hold_s(1.0) == 0.05  # looked at again after recheck_s
    assert abs(g.hold_s(1.07) - 0.03) < 1e-9
    assert g.hold_s(1.1) <= 0  # held long enough
    g.add([str(i) for i in range(9)], now=1.05)
    assert len(g.pending) == 10 and g.hold_s(1.05) <= 0  # a full doorbell goes at once


def test_a_worker_freeing_up_releases_what_is_held():
    busy = [True]
    g = _gather(busy)
    g.add(["a", "b"], now=1.0)
    assert g.hold_s(1.02) > 0
    busy[0] = False
    assert g.hold_s(1.03) <= 0 and g.take(1.03) == ["a", "b"] and g.pending == []
