"""The engine's in-flight pool (workers/engine/in_flight.py) outlives what goes wrong around a commit:
a doorbell whose breakers cannot be told still ends, and the committer goes on committing the next."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outbox.ledger.claims import Claim
from workers.engine.in_flight import Batch, InFlightPool, Lane


class _Claim:
    def __init__(self, operation_id: str) -> None:
        self.operation_id = operation_id


class _Work:
    """Each claim's result is its id; a commit writes "ok" for each."""

    def target_of(self, claim: Claim) -> str | None:
        return "t"

    def spread(self, target: str | None) -> bool:
        return False

    def may_hand_off(self, target: str | None) -> bool:
        return True

    def run(self, lane: Lane[Any, str], claim: Claim) -> Any:
        return claim

    def claim_of(self, result: Any) -> Claim:
        return result  # type: ignore[no-any-return]

    def commit(self, results: Sequence[tuple[Batch[Any, str], Any]]) -> dict[str, str]:
        return {r.operation_id: "ok" for _, r in results}

    def unwritten(self, result: Any) -> str | None:
        return None


class _Admissions:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def tell_successes(self) -> None:
        if self.fail:
            raise RuntimeError("the breakers' Redis went away mid-telling")


def test_a_doorbell_whose_breakers_cannot_be_told_still_ends_and_the_next_commits() -> None:
    pool = InFlightPool(_Work(), max_ops=4, name="test", record=lambda held: None)  # type: ignore[arg-type]
    try:
        assert pool.room.take(1, timeout_s=1) == 1  # a doorbell takes room before it claims
        first = pool.start([_Claim("a")], _Admissions(fail=True), None)  # type: ignore[list-item,arg-type]
        assert first.result(timeout=5) == {"a": "ok"}
        assert pool.room.take(1, timeout_s=1) == 1
        second = pool.start([_Claim("b")], _Admissions(fail=False), None)  # type: ignore[list-item,arg-type]
        assert second.result(timeout=5) == {"b": "ok"}
        assert pool.room.held == 0
    finally:
        pool.close(1.0)
