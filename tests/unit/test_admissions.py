"""A batch's admissions (breaker/admissions.py) over a real process-local registry, injected clock."""

from __future__ import annotations

from breaker import Admissions, Allowed, BreakerConfig, BreakerRegistry, Open, status

T0 = 1_700_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock) -> BreakerRegistry:
    return BreakerRegistry({"payments": BreakerConfig(fail_max=3, reset_timeout_s=30)}, clock=clock)


def failures(registry: BreakerRegistry) -> int:
    return status(registry, ["payments"])[0].failures


def half_open(registry: BreakerRegistry, clock: Clock) -> None:
    for _ in range(3):
        decision = registry.before_call("payments")
        assert isinstance(decision, Allowed)
        registry.record(decision, failure=True)
    clock.now += 31  # past the reset timeout: the next caller probes


def test_a_closed_breakers_admission_is_asked_once_and_shared_by_the_batch() -> None:
    admissions = Admissions(make(Clock()))
    first = admissions.ask("payments")
    assert isinstance(first, Allowed) and not first.probe
    assert admissions.ask("payments") is first
    assert admissions.answer_for("op-2", "payments") is first
    assert admissions.share(["payments", "payments"]) == {"payments": first}


def test_successes_wait_for_the_batchs_end_and_failures_are_told_at_once() -> None:
    registry = make(Clock())
    admissions = Admissions(registry)
    decision = admissions.answer_for("op-1", "payments")
    assert isinstance(decision, Allowed)
    admissions.went(decision, failure=True)
    admissions.went(decision, failure=True)
    assert failures(registry) == 2  # told as they happened
    admissions.went(decision, failure=False)
    assert failures(registry) == 2 and admissions.success_waiting("payments")
    admissions.tell_successes()
    assert failures(registry) == 0 and not admissions.success_waiting("payments")
    assert not admissions.tell_success("payments")  # told once


def test_a_probe_held_by_an_operation_not_claimed_is_given_back_to_the_next_caller() -> None:
    clock = Clock()
    registry = make(clock)
    half_open(registry, clock)
    admissions = Admissions(registry)
    probe = admissions.ask("payments")
    assert isinstance(probe, Allowed) and probe.probe
    admissions.hold("op-1", probe)
    assert admissions.answer_for("op-1", "payments") is probe
    assert isinstance(registry.before_call("payments"), Open)  # the fleet's one probe is taken
    admissions.give_back_all(keep=["op-2"])  # op-1 was not claimed
    assert not admissions.holds("op-1")
    again = registry.before_call("payments")
    assert isinstance(again, Allowed) and again.probe


def test_sharing_gives_a_probe_back_at_once_so_the_first_call_to_ask_takes_it() -> None:
    clock = Clock()
    registry = make(clock)
    half_open(registry, clock)
    admissions = Admissions(registry)
    shared = admissions.share(["payments"])["payments"]
    assert isinstance(shared, Allowed) and shared.probe
    call = admissions.answer_for("op-1", "payments")  # nothing shared: this call asks, and probes
    assert isinstance(call, Allowed) and call.probe and call.probe_token != shared.probe_token


def test_after_a_failure_the_reconcilers_lookups_ask_again_and_dispatchs_calls_keep_the_admission() -> None:
    for ask_again, keeps in ((True, False), (False, True)):
        admissions = Admissions(make(Clock()), ask_again_after_failure=ask_again)
        shared = admissions.share(["payments"])["payments"]
        assert isinstance(shared, Allowed)
        admissions.went(shared, failure=True)
        assert (admissions.answer_for("op-2", "payments") is shared) is keeps
