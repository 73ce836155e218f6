"""The API's backlog gate (producer/http/intake.py) on both ledgers: what counts as the backlog,
the bounded count, the second-old cache, replays answered. The HTTP side (a real server, effects
counted at the sandbox) is tests/integration/surfaces/test_api.py."""

from __future__ import annotations

import time

from sqlalchemy import update

from outbox.ledger.models import Operation
from outbox.service import operations
from producer import submit
from producer.http import intake
from producer.http.intake import BacklogGate


def _submit(ledger, tenant: str, key: str) -> str:
    with ledger.sessions.begin() as s:
        return submit(s, tenant=tenant, idempotency_key=key, action="a.b", args={"n": key}, subject="t").operation_id


def test_the_backlog_counts_what_the_fleet_owes_up_to_the_limit(ledger):
    ids = [_submit(ledger, "acme", f"k{i}") for i in range(5)]
    _submit(ledger, "globex", "k0")
    with ledger.sessions.begin() as s:
        s.execute(update(Operation).where(Operation.id == ids[0]).values(status="outcome_unknown"))
        s.execute(update(Operation).where(Operation.id == ids[1]).values(status="succeeded"))
        s.execute(update(Operation).where(Operation.id == ids[2]).values(status="awaiting_approval"))
    with ledger.sessions() as s:
        assert operations.backlog(s, "acme", up_to=100) == 3  # 2 not_dispatched + 1 outcome_unknown
        assert operations.backlog(s, "acme", up_to=1) == 2  # bounded per status
        assert operations.backlog(s, "globex", up_to=100) == 1
        assert operations.key_taken(s, "acme", "k1") and not operations.key_taken(s, "acme", "k9")
        assert not operations.key_taken(s, "globex", "k1")


def test_the_gate_refuses_new_keys_past_the_limit_and_answers_replays(ledger, monkeypatch):
    for i in range(2):
        _submit(ledger, "acme", f"k{i}")
    with ledger.sessions() as s:
        assert BacklogGate(0).refusal(s, "acme", "new") is None  # off
        assert BacklogGate(3).refusal(s, "acme", "new") is None  # under the limit
        gate = BacklogGate(2)
        refused = gate.refusal(s, "acme", "new")
        assert refused is not None and refused.status == 429 and refused.headers == {"Retry-After": "2"}
        assert refused.body()["type"].endswith("/backlog-full") and refused.members == {"backlog": 2, "limit": 2}
        assert gate.refusal(s, "acme", "k1") is None  # a replay
        assert gate.refusal(s, "acme", None) is None  # left to submit's validation
        assert gate.refusal(s, "globex", "new") is None  # per tenant
    # Counted at most once per BACKLOG_CHECK_S: drained rows show at the next count.
    with ledger.sessions.begin() as s:
        s.execute(update(Operation).values(status="succeeded"))
    with ledger.sessions() as s:
        assert gate.refusal(s, "acme", "new") is not None  # the count of a moment ago
        monkeypatch.setattr(intake, "BACKLOG_CHECK_S", 0.0)
        time.sleep(0.01)
        assert gate.refusal(s, "acme", "new") is None
