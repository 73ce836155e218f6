"""A worker process's room (workers/engine/room.py): a doorbell waits for one place, not a batch's,
then gathers for a moment (bounded) so that a starved process does not claim one operation at a time."""

from __future__ import annotations

import threading
import time

from workers.engine.room import Room


def _room(max_ops: int, gather_s: float = 0.02) -> tuple[Room, list[int]]:
    seen: list[int] = []
    return Room(max_ops, seen.append, gather_s=gather_s), seen


def test_an_empty_process_takes_the_whole_batch_even_past_max_ops() -> None:
    room, seen = _room(4)
    assert room.take(10, timeout_s=0) == 10  # as before: a batch larger than the room still runs
    assert room.held == 10 and seen == [10]


def test_a_busy_process_takes_what_fits_now() -> None:
    room, _ = _room(10)
    assert room.take(10, timeout_s=0) == 10
    room.give_back(3)  # three calls of the batch finalized, seven still out (one of them stalled)
    assert room.take(10, timeout_s=0) == 3
    assert room.held == 10


def test_a_full_process_waits_for_one_place_then_takes_it() -> None:
    room, _ = _room(2)
    assert room.take(2, timeout_s=0) == 2
    assert room.take(1, timeout_s=0.05) == 0  # full: nothing on timeout
    threading.Timer(0.05, room.give_back, args=(1,)).start()
    began = time.monotonic()
    assert room.take(5, timeout_s=5) == 1
    assert time.monotonic() - began < 4


def test_a_full_process_gathers_half_its_room_when_places_free_up_one_by_one() -> None:
    room, _ = _room(40, gather_s=30)  # a long moment, so the test does not race the timer
    assert room.take(40, timeout_s=0) == 40
    room.give_back(1)  # the committer finalized one call...
    threading.Timer(0.05, room.give_back, args=(19,)).start()  # ...then the rest of a batch
    assert room.take(20, timeout_s=60) == 20  # one claim of 20, not one of 1 and another of 19
    assert room.held == 40


def test_the_gathering_is_bounded_and_a_small_doorbell_does_not_gather() -> None:
    room, _ = _room(40, gather_s=0.05)
    assert room.take(40, timeout_s=0) == 40
    room.give_back(3)
    began = time.monotonic()
    assert room.take(20, timeout_s=60) == 3  # nothing more freed: what fits once the moment is over
    assert 0.04 <= time.monotonic() - began < 30
    small, _ = _room(40, gather_s=30)  # a wait would show as 30 s
    assert small.take(40, timeout_s=0) == 40
    small.give_back(3)
    began = time.monotonic()
    assert small.take(3, timeout_s=60) == 3  # the doorbell asks no more than fits: no wait
    assert time.monotonic() - began < 10


def test_a_doorbell_whose_room_another_took_while_it_gathered_waits_for_a_place_again() -> None:
    room, _ = _room(4, gather_s=1.0)
    assert room.take(4, timeout_s=0) == 4
    room.give_back(1)
    got: list[int] = []
    gatherer = threading.Thread(target=lambda: got.append(room.take(4, timeout_s=30)))
    gatherer.start()  # one place free, two wanted: it gathers
    time.sleep(0.05)
    assert room.take(1, timeout_s=0) == 1  # another doorbell (a threads pool) takes that place
    time.sleep(1.3)  # the gathering is over with the room full: it must not go with nothing
    room.give_back(1)
    gatherer.join(10)
    assert got == [1]


def test_close_lets_a_waiter_go_with_nothing_and_wait_empty_says_what_is_left() -> None:
    room, _ = _room(1)
    room.take(1, timeout_s=0)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(room.take(1, timeout_s=30)))
    waiter.start()
    time.sleep(0.05)
    assert room.wait_empty(0.05) == 1
    room.close()
    waiter.join(5)
    assert got == [0]
    room.give_back(1)
    assert room.wait_empty(0) == 0
    assert room.take(1, timeout_s=0) == 0  # closed: no room even when empty (the process stops)
