"""Limits as declared and as one process keeps them: the actions file's shape, the GCRA and the slots
on an injected clock (nothing sleeps). Shared limits in Redis: tests/integration/dispatch/test_pacing_redis.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.cli.main import main
from workers.pacing import Cleared, Deferred, Pacer, Rate, limits_of
from workers.provider.actions import ActionsFileError, parse_actions

DOC: dict[str, Any] = {
    "targets": {
        "payments": {
            "base_url": "https://payments.example.com",
            "timeout_s": 2,
            "connect_timeout_s": 1,
            "rate_limit": {"per_s": 50, "burst": 5},
            "max_in_flight": 2,
            "tenants": {"acme": {"rate_limit": {"per_s": 2.5}}},
        },
        "support": {"base_url": "https://support.example.com"},
    },
    "actions": {
        "payments.refund.create": {"target": "payments", "request": {"method": "POST", "path": "/v1/refunds"}},
        "support.ticket.create": {"target": "support", "request": {"method": "POST", "path": "/v1/tickets"}},
    },
}


class Clock:
    """Monotonic time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


def rate_only() -> dict[str, Any]:
    """DOC with payments held to its rates alone (no concurrency limit)."""
    doc = copy.deepcopy(DOC)
    del doc["targets"]["payments"]["max_in_flight"]
    return doc


def pacer(clock: Clock, doc: dict[str, Any] = DOC) -> Pacer:
    return Pacer(limits_of(parse_actions(doc)), process_id="p1", sleep=clock.sleep, clock=clock, rng=lambda: 0.0)


def test_limits_are_read_per_target_and_per_tenant() -> None:
    cfg = parse_actions(DOC)
    limits = limits_of(cfg)
    assert set(limits) == {"payments"}  # a target without limits asks nobody
    pay = limits["payments"]
    # burst left out: one second's worth (ceil(2.5) = 3)
    assert (pay.rate, pay.max_in_flight, dict(pay.tenant_rates)) == (Rate(50, 5), 2, {"acme": Rate(2.5, 3)})
    assert pay.call_s == 3.0
    assert pay.describe() == "50/s (burst 5); 2 in flight; tenant acme: 2.5/s (burst 3)"
    # An entry that only declares a limit lends no account: every tenant still uses the target's headers.
    assert cfg.targets["payments"].accounts == {} and cfg.targets["payments"].headers_for("other") == {}


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"rate_limit": {"per_s": 0}}, "targets.payments.rate_limit.per_s", "greater than 0"),
        ({"rate_limit": {"per_s": 5, "burst": 0}}, "targets.payments.rate_limit.burst", "greater than or equal to 1"),
        ({"rate_limit": {"per_s": 5, "burst": 2.5}}, "targets.payments.rate_limit.burst", "integer"),
        ({"rate_limit": {"per_s": 5, "bursts": 2}}, "targets.payments.rate_limit.bursts", "Extra inputs"),
        ({"max_in_flight": 0}, "targets.payments.max_in_flight", "greater than or equal to 1"),
        (
            {"tenants": {"acme": {"rate_limit": {"per_s": -1}}}},
            "targets.payments.tenants.acme.rate_limit.per_s",
            "greater than 0",
        ),
    ],
)
def test_a_bad_limit_names_its_dotted_path(change: dict[str, Any], path: str, words: str) -> None:
    doc = copy.deepcopy(DOC)
    doc["targets"]["payments"].update(change)
    with pytest.raises(ActionsFileError) as exc:
        parse_actions(doc)
    assert any(p == path and words in msg for p, msg in exc.value.problems), exc.value.problems


def test_actions_check_reports_a_bad_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = copy.deepcopy(DOC)
    doc["targets"]["payments"]["rate_limit"] = {"per_s": 0}
    path = tmp_path / "actions.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["actions", "check", str(path)]) == 1
    assert "targets.payments.rate_limit.per_s: Input should be greater than 0" in capsys.readouterr().out.splitlines()


def test_a_burst_goes_at_once_then_one_interval_apart_each_turn_reserved() -> None:
    clock = Clock()
    doc = rate_only()
    p = pacer(clock, doc)
    # Five at once (the burst); each next one is given the turn one interval (20 ms at 50/s) after
    # the last, and sleeps to it: it never asks twice.
    got = [p.clear("payments", "beta", max_wait_s=1.0) for _ in range(8)]
    assert all(isinstance(c, Cleared) for c in got)
    assert clock.slept == [0.02, 0.02, 0.02]
    assert got[4].note() is None  # type: ignore[union-attr]
    assert got[5].note() == "waited 0.020s for the rate limit of target payments: 50/s"  # type: ignore[union-attr]


def test_a_wait_longer_than_allowed_goes_back_to_the_ledger_naming_the_limit() -> None:
    clock = Clock()
    p = pacer(clock)
    first = p.clear("payments", "acme", max_wait_s=1.0)
    assert isinstance(first, Cleared)
    p.done(first)
    # acme: 2.5/s, burst 3: the fourth call at the same instant has its turn 0.4 s away, too far.
    for _ in range(2):
        p.done(p.clear("payments", "acme", max_wait_s=1.0))  # type: ignore[arg-type]
    later = p.clear("payments", "acme", max_wait_s=0.01)
    assert isinstance(later, Deferred) and later.limit == "rate"
    assert later.why == "rate limit of tenant acme at target payments: 2.5/s"
    assert later.wait_s == pytest.approx(0.4)  # three turns of 0.4 s taken, a burst of three tolerated
    # Those sent back queue up: each comes back one interval after the one before it, so a backlog
    # returns at the rate it can be sent, not all at once to be sent back again.
    queued = [p.clear("payments", "acme", max_wait_s=0.01) for _ in range(3)]
    assert [q.wait_s for q in queued] == pytest.approx([0.8, 1.2, 1.6])  # type: ignore[union-attr]
    # Another tenant is held only by the target's own rate.
    assert isinstance(p.clear("payments", "beta", max_wait_s=0.0), Cleared)


def test_calls_sent_back_take_their_place_in_their_tenants_line_so_tenants_share_the_turns() -> None:
    clock = Clock()
    doc = rate_only()
    p = pacer(clock, doc)
    # big's backlog: five go (the burst), fifty are sent back one turn (20 ms at 50/s) after another.
    big = [p.clear("payments", "big", max_wait_s=0.0) for _ in range(55)]
    waits = [c.wait_s for c in big if isinstance(c, Deferred)]
    assert len(waits) == 50 and waits[0] == pytest.approx(0.02) and waits[-1] == pytest.approx(1.0)
    # small's call comes back at the rate's first free turn, not behind big's whole line...
    small = p.clear("payments", "small", max_wait_s=0.0)
    assert isinstance(small, Deferred) and small.wait_s == pytest.approx(0.02)
    # ...and big's next ones stay in big's own line.
    after = [p.clear("payments", "big", max_wait_s=0.0) for _ in range(2)]
    assert [c.wait_s for c in after] == pytest.approx([1.02, 1.04])  # type: ignore[union-attr]


def test_a_tenant_holds_only_its_share_of_the_turns_ahead_so_another_is_not_sent_back() -> None:
    doc = rate_only()
    clock = Clock()
    # The calls sleep in threads of their own: time moves only when the test moves it.
    slept: list[float] = []
    p = Pacer(limits_of(parse_actions(doc)), process_id="p1", sleep=slept.append, clock=clock, rng=lambda: 0.0)
    # 50/s, a burst of five: big alone holds the next 0.8 s's turns (SHARE_HORIZON_S: 40 of 20 ms),
    # each in a thread waiting for it; its next call, though its turn (0.82 s) is within the second
    # it may wait, goes back to its line.
    big = [p.clear("payments", "big", max_wait_s=1.0) for _ in range(46)]
    assert all(isinstance(c, Cleared) for c in big[:45])
    assert isinstance(big[45], Deferred) and big[45].wait_s == pytest.approx(0.82)
    # small arrives behind those turns: it holds none, so it takes the next one (0.82 s away) in its
    # thread instead of being sent back for the turns big keeps taken.
    small = p.clear("payments", "small", max_wait_s=1.0)
    assert isinstance(small, Cleared) and slept[-1] == pytest.approx(0.82)
    # Two tenants active: big's share is 20 turns. 0.3 s on, it still holds 25 (its next turn 0.54 s
    # away, well within its wait): sent back all the same, the turns left for others.
    clock.now += 0.3
    later = p.clear("payments", "big", max_wait_s=1.0)
    assert isinstance(later, Deferred) and later.wait_s == pytest.approx(0.84 - 0.3)


def test_no_free_slot_waits_briefly_then_goes_back_and_a_slot_given_back_serves_the_next() -> None:
    clock = Clock()
    p = pacer(clock)
    a, b = p.clear("payments", "t", max_wait_s=1.0), p.clear("payments", "t", max_wait_s=1.0)
    assert isinstance(a, Cleared) and isinstance(b, Cleared)
    full = p.clear("payments", "t", max_wait_s=0.2)
    assert isinstance(full, Deferred) and full.limit == "concurrency"
    assert full.why == "concurrency limit of target payments: 2 in flight" and 0.5 <= full.wait_s <= 1.0
    p.done(a)
    again = p.clear("payments", "t", max_wait_s=0.2)
    assert isinstance(again, Cleared)


def test_a_target_without_limits_is_cleared_without_asking_anyone() -> None:
    clock = Clock()
    # A Redis URL nobody listens on: asking it would fail over to the local share, and say so.
    p = Pacer(limits_of(parse_actions(DOC)), process_id="p1", redis_url="redis://127.0.0.1:1/0", clock=clock)
    for _ in range(100):
        assert p.clear("support", "t", max_wait_s=1.0) == Cleared("support")
    assert not p.degraded
    assert Pacer({}, process_id="p1", redis_url="redis://127.0.0.1:1/0")._client is None  # no limits: no client


def test_a_share_is_never_more_than_the_whole() -> None:
    assert Rate(50, 20).shared_by(4) == Rate(12.5, 5)
    assert Rate(50, 3).shared_by(4) == Rate(12.5, 1)  # at least one at once
    assert limits_of(parse_actions(DOC))["payments"].slots(4) == 1


def test_an_attempt_and_a_lookup_with_no_room_are_not_sent_and_cost_nothing() -> None:
    """Both call paths ask the pacer right before the request leaves (the same Downstream.pace): with
    no room within the call's lease, the attempt is refunded and waits for rate_limit, the lookup is
    looked up later; the connector is never called."""
    import datetime as dt

    from breaker import Admissions, BreakerConfig, BreakerRegistry
    from outbox.ledger.claims import Claim
    from outbox.ledger.states import AttemptClass, WaitingFor
    from workers.dispatch.fan_out import attempt
    from workers.dispatch.gate import SendChecks
    from workers.engine.downstream import Downstream
    from workers.engine.outcomes import RetryAt
    from workers.reconcile.lookup import ask

    class NoCalls:
        def for_action(self, name: str) -> Any:
            raise AssertionError("nothing may be sent")

    cfg = parse_actions(DOC)
    clock = Clock()
    p = pacer(clock)
    for _ in range(5):  # the burst of 5 spent (each slot given back)
        p.done(p.clear("payments", "t", max_wait_s=0.0))  # type: ignore[arg-type]
    down = Downstream(cfg, NoCalls(), p)  # type: ignore[arg-type]
    admissions = Admissions(BreakerRegistry({"payments": BreakerConfig(fail_max=5, reset_timeout_s=30)}))
    now = dt.datetime.now(dt.UTC)

    def claim(kind: str) -> Claim:
        # The lease ends before the call's timeouts (3 s) could: no wait in the thread is allowed.
        return Claim(
            "op",
            2,
            7,
            2,
            kind,
            "t",
            "k",
            "payments.refund.create",
            "{}",
            "d",
            "s",
            "w",  # type: ignore[arg-type]
            now + dt.timedelta(seconds=1),
            None,
            2,
            None,
            now,
            False,
            False,
        )

    report, outcome = attempt(down, admissions, claim("dispatch"), cfg.action("payments.refund.create"), SendChecks())
    assert (
        report.klass is AttemptClass.NOT_SENT
        and report.error
        and report.error.startswith("rate limit of target payments: 50/s: not sent")
    )
    assert isinstance(outcome, RetryAt) and outcome.refund_attempt and outcome.waiting_for is WaitingFor.RATE_LIMIT
    asked = ask(down, admissions, claim("lookup"))
    assert asked.early is not None and asked.early.reason == "rate limit of target payments: 50/s: lookup later"
    assert asked.early.klass is AttemptClass.NOT_SENT  # never asked: no lookup of the reconciler's budget
    assert asked.early.recheck_in_s > 0
