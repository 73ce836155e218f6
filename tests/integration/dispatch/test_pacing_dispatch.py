"""Declared limits, end to end: two real worker processes share a target's rate through Redis; the
sandbox's request log (arrival times) is the judge, and the ledger shows no attempt charged for a
wait, and `ops show` says who waited for which limit."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import select

from outbox.ledger.history import HistoryEvent
from outbox.ledger.models import Operation
from outbox.ledger.states import Status
from tests.harness import REFUND_ARGS, actions_doc, max_in_any_window, pk, wait_for
from workers.cli.main import main
from workers.pacing.limits import SHARE_HORIZON_S
from workers.service.breakers import board

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

RATE = 20.0


def limited(sandbox_url: str, **limits: Any) -> dict[str, Any]:
    doc = actions_doc(sandbox_url)
    doc["targets"]["sandbox"].update(limits)
    return doc


def test_two_workers_keep_to_a_targets_rate_together(pipe, sandbox, monkeypatch, capsys):
    # burst 1: "20/s" at any scale; a burst of 20 would let 40 through in the first second.
    pipe.write_actions(limited(sandbox.url, rate_limit={"per_s": RATE, "burst": 1}))
    pipe.start_worker("w1")
    pipe.start_worker("w2")
    pipe.start_relay()
    n = 100
    keys = [f"paced-{i:03d}" for i in range(n)]
    ids = [pipe.submit(k, dict(REFUND_ARGS, order_id=f"o-{i}")).operation_id for i, k in enumerate(keys)]
    wait_for(lambda: len(sandbox.requests(path="/v1/refunds", method="POST")) >= 40, 20, what="two seconds of sends")

    # The breakers page (and `breakers status`) shows the declared limits and what the fleet admits now.
    # Admitted = turns handed out in the last second (up to 1 s ahead): between 1 and two seconds of
    # turns. Read until a second with turns in it: calls sent back to the ledger wait for the relay's
    # next ring, and on a loaded machine a whole second without a turn was seen (CI, 08:2x).
    def admitting() -> Any:
        [row] = board(pipe.settings()).breakers
        return row if row.admitted_last_s else None

    row = wait_for(admitting, 3, what="a second with turns admitted")
    assert row.limits == "20/s (burst 1)" and 0 < row.admitted_last_s <= 41
    wait_for(
        lambda: pipe.count(Status.SUCCEEDED.value) == n,
        30,
        what=lambda: f"{n} succeeded (now {pipe.count('succeeded')})",
    )

    sent = sandbox.requests(path="/v1/refunds", method="POST")
    times = [r["time"] for r in sent]
    span = max(times) - min(times)
    # One send a turn of 50 ms, reserved in Redis. The sandbox sees arrivals, which carry each call's
    # own jitter: a process's first calls (new connections, a busy start) arrive tens of ms late, so
    # the next look early. So: over any 2 s window after the first second, at most the rate's sends in
    # 2 s plus 500 ms of transit jitter (45 seen on a two-core machine running the suite's 4 processes
    # at once, 47 in a later CI run: calls cleared on time, held up on their way by a stalled process,
    # arrive together), where two workers each keeping the rate alone would put 80; in the first
    # second, at most eight over (20-24 seen there on a loaded two-core machine: first arrivals 200 ms
    # late; 26 in a CI run that took 10 minutes instead of 8), where an undeclared burst (20) would
    # put 40. Arrivals are never earlier than their turns, only later: a window over its turns holds
    # calls a stalled process held up.
    assert max_in_any_window(times, 2.0, after_s=1.0) <= RATE * (2.0 + 0.5) + 1, sorted(times)
    assert max_in_any_window(times, 1.0) <= RATE + 8, sorted(times)
    assert span >= (n - 1) / RATE * 0.95  # the limit, not something slower, set the pace ...
    # ... and the fleet reached it: its busiest 2 s held at least 80% of the rate's sends. The whole
    # span is only bounded loosely (2x): on a loaded two-core CI machine a late stall (a sent-back
    # call's second turn, a slow process) stretched the tail to 7.5 s for 4.95 s of turns, with every
    # second before it at the rate.
    assert max_in_any_window(times, 2.0) >= 2 * RATE * 0.8, sorted(times)
    assert span <= (n - 1) / RATE * 2.0
    assert not [r for r in sent if r["status"] == 429]
    assert Counter(e["idempotency_key"] for e in sandbox.effects()) == Counter(pk(k) for k in keys)

    with pipe.sessions() as s:
        rows = s.execute(select(Operation.id, Operation.attempt_count).where(Operation.id.in_(ids))).all()
    assert {count for _, count in rows} == {1}, "a wait for a limit costs no attempt"

    # Both ways of waiting are on record: in the call's thread (said in the attempt's event), and sent
    # back to the ledger (an attempt not_sent, not counted, waiting_for rate_limit); `ops show` says so.
    with pipe.sessions() as s:
        events = s.execute(select(HistoryEvent.operation_id, HistoryEvent.reason)).all()
    waited = [op for op, why in events if "for the rate limit of target sandbox: 20/s)" in (why or "")]
    sent_back = [op for op, why in events if "not_sent: rate limit of target sandbox: 20/s" in (why or "")]
    assert waited and sent_back
    monkeypatch.setenv("OUTBOX_DATABASE_URL", pipe.env["OUTBOX_DATABASE_URL"])
    assert main(["ops", "show", sent_back[0], "--tenant", "t1", "--json"]) == 0
    history = [e["reason"] for e in json.loads(capsys.readouterr().out)["history"]]
    assert any(r.startswith("attempt 1 not_sent: rate limit of target sandbox: 20/s") for r in history), history


def test_another_tenant_is_not_put_behind_one_tenants_backlog_at_a_limited_target(pipe, sandbox):
    # 50/s (burst 50), two workers: big's 300 intents are six seconds of turns, and big holds the
    # turns of the next 0.8 s (SHARE_HORIZON_S), each in a call's thread. Two seconds in, small
    # submits one. Its call takes the turn right after the ones big holds, in its thread: never sent
    # back to wait in the ledger (with one line for every tenant, a call sent back waited behind the
    # whole backlog: bench.fairness, 18-20 s behind 1,500). At the provider, the calls of big's that
    # arrive between small's submit and its call are the ones big held, plus those cleared while
    # small's intent went from the submit to its claim (50/s of that latency): bounded loosely.
    rate = 50
    pipe.write_actions(limited(sandbox.url, rate_limit={"per_s": rate, "burst": rate}))
    pipe.start_worker("w1")
    pipe.start_worker("w2")
    pipe.start_relay()
    big = [pipe.submit(f"big-{i:03d}", dict(REFUND_ARGS, order_id=f"b-{i}"), tenant="big") for i in range(300)]
    wait_for(lambda: len(sandbox.requests(path="/v1/refunds", method="POST")) >= 2 * rate, 20, what="big's 2 s")
    before = len(sandbox.requests(path="/v1/refunds", method="POST"))
    small = pipe.submit("small-1", dict(REFUND_ARGS, order_id="s-1"), tenant="small")
    wait_for(lambda: pipe.statuses([small.operation_id]) == {small.operation_id: "succeeded"}, 30, what="small")
    keys = [r["idempotency_key"] for r in sandbox.requests(path="/v1/refunds", method="POST")]
    between = keys.index(pk("small-1", "small")) - before
    print(f"{between} of big's calls arrived between small's submit and its call")
    assert [a.attempt_class for a in pipe.attempts(small.operation_id)] == ["succeeded"]  # never sent back
    assert between <= SHARE_HORIZON_S * rate + 30, f"{between} of big's calls went before small's"
    wait_for(lambda: pipe.count(Status.SUCCEEDED.value) == len(big) + 1, 30, what="everything settled")
    assert sorted(e["idempotency_key"] for e in sandbox.effects()) == sorted(
        [pk(f"big-{i:03d}", "big") for i in range(300)] + [pk("small-1", "small")]
    )
