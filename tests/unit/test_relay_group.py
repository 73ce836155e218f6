"""A fleet's relays run as one (workers/relay/fleet.py): one relay's loop dying stops them all, so
the process ends and is restarted instead of running on with a ledger's relay silently gone."""

from __future__ import annotations

import threading

import pytest

from workers.relay.fleet import RelayGroup


class _Relay:
    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails = name, fails
        self.stopped = threading.Event()

    def run_forever(self) -> None:
        if self.fails:
            raise ValueError("a bug in one relay's loop")
        self.stopped.wait(10)

    def stop(self) -> None:
        self.stopped.set()


def test_one_relay_dying_stops_the_group_and_says_so():
    healthy, broken = _Relay("relay (ledger a)"), _Relay("relay (ledger b)", fails=True)
    group = RelayGroup([healthy, broken])  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="a relay of the group stopped") as err:
        group.run_forever()
    assert isinstance(err.value.__cause__, ValueError)
    assert healthy.stopped.is_set()


def test_stop_stops_every_relay():
    relays = [_Relay("a"), _Relay("b")]
    group = RelayGroup(relays)  # type: ignore[arg-type]
    runner = threading.Thread(target=group.run_forever)
    runner.start()
    group.stop()
    runner.join(5)
    assert not runner.is_alive() and all(r.stopped.is_set() for r in relays)
