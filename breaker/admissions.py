"""One batch's admissions: may this call go now, and how did it go.

A worker handles calls (or lookups) in batches: one doorbell's operations, several to the same
target. Asking the breaker once per call would cost a round trip to Redis per call, and telling it
each success another; so a batch shares what the breaker answered:

- a closed breaker admits every call: asked once per target, its admission is shared by the batch's
  calls to that target, and their successes are told once (``tell_successes``), while each failure
  is told at once (so failures from every process still add up to fail_max in time);
- a half-open breaker admits one probe in the whole fleet: that admission belongs to one operation
  (``hold``), and a probe the batch will not send is given back (``release``, ``give_back``) so the
  next caller probes now instead of every caller waiting for the probe lock to expire;
- an open breaker is an answer like the others: the caller parks or reschedules the operation.

The dispatch gate asks per operation before claiming (``ask`` + ``hold``); what a claim took along
and the reconciler's lookups are asked once per target (``share``). Calls then take their answer
with ``answer_for`` and report with ``went``. Used from several threads of one batch: each step is
one dict operation (atomic in CPython), never a lock across a call.
"""

from __future__ import annotations

from collections.abc import Iterable

from breaker.registry import BreakerRegistry
from breaker.state import Allowed, Decision


class Admissions:
    """The breakers' answers for one batch of calls (see the module docstring).

    ``ask_again_after_failure``: after a counted failure the batch's calls to that target stop
    sharing the closed admission and ask the breaker again (the reconciler's lookups). Without it
    they keep it (dispatch: the process's canary rule, dispatch/in_flight.py, makes each call to a
    failing target ask in turn instead).
    """

    def __init__(self, breakers: BreakerRegistry, *, ask_again_after_failure: bool = False) -> None:
        self._breakers = breakers
        self._ask_again_after_failure = ask_again_after_failure
        self._held: dict[str, Decision] = {}  # operation id -> its own answer (a probe, an open breaker)
        self._closed: dict[str, Allowed] = {}  # target -> the closed breaker's admission, shared
        self._succeeded: dict[str, Allowed] = {}  # target -> a success not yet told

    # -- before the calls -------------------------------------------------------------------
    def ask(self, target: str) -> Decision:
        """The answer for one more call to ``target``: the batch's closed admission, or the
        breaker asked (a closed admission it gives is kept for the batch)."""
        decision = self._closed.get(target) or self._breakers.before_call(target)
        if isinstance(decision, Allowed) and not decision.probe:
            self._closed[target] = decision
        return decision

    def hold(self, operation_id: str, decision: Decision) -> None:
        """``decision`` is this operation's (until it is sent, or given back)."""
        self._held[operation_id] = decision

    def holds(self, operation_id: str) -> bool:
        return operation_id in self._held

    def share(self, targets: Iterable[str]) -> dict[str, Decision]:
        """Each target asked once for the batch: a closed admission is shared; a probe is given
        back at once (the first call to ask takes it); an open breaker is returned, not kept."""
        answers: dict[str, Decision] = {}
        for target in dict.fromkeys(targets):
            if target in self._closed:
                answers[target] = self._closed[target]
                continue
            decision = self._breakers.before_call(target)
            if isinstance(decision, Allowed) and not decision.probe:
                self._closed[target] = decision
            else:
                self._breakers.release(decision)
            answers[target] = decision
        return answers

    # -- the calls --------------------------------------------------------------------------
    def answer_for(self, operation_id: str, target: str) -> Decision:
        """The answer a call goes with: its own, the batch's closed admission, or the breaker asked
        now (that answer is the call's alone)."""
        held = self._held.get(operation_id)
        if held is not None:
            return held
        return self._closed.get(target) or self._breakers.before_call(target)

    def went(self, decision: Allowed, *, failure: bool) -> None:
        """How an admitted call went (``failure`` from ``counts_as_failure``). A success under the
        closed breaker waits to be told with the batch's others; anything else is told now."""
        if not failure and not decision.probe:
            self._succeeded[decision.target] = decision
            return
        if self._ask_again_after_failure:
            self._closed.pop(decision.target, None)
        self._breakers.record(decision, failure=failure)

    def release(self, decision: Decision | None) -> None:
        """A call that will not be sent with ``decision``: a probe is given back."""
        if decision is not None:
            self._breakers.release(decision)

    def give_back(self, operation_id: str) -> None:
        """The operation's own answer, unused (or its call cut part-way): a probe is given back."""
        self.release(self._held.pop(operation_id, None))

    def give_back_all(self, *, keep: Iterable[str] = ()) -> None:
        """Every operation's own answer but ``keep``'s (the operations not claimed, or all of them
        when the claim failed): a probe taken and never sent would hold the half-open breaker shut
        for every process until its lock expires."""
        kept = set(keep)
        for operation_id in [op_id for op_id in self._held if op_id not in kept]:
            self.give_back(operation_id)

    def unshare(self, target: str) -> None:
        """The batch's calls to ``target`` stop sharing its closed admission: each asks again."""
        self._closed.pop(target, None)

    def share_success(self, target: str) -> None:
        """A call to ``target`` answered well under a closed breaker: the batch's other calls go on
        with that admission instead of each asking again."""
        admitted = self._succeeded.get(target)
        if admitted is not None:
            self._closed.setdefault(target, admitted)

    # -- telling successes ------------------------------------------------------------------
    def success_waiting(self, target: str) -> bool:
        return target in self._succeeded

    def tell_success(self, target: str) -> bool:
        """Tell the breaker now of a success waiting for ``target`` (False: none was waiting)."""
        decision = self._succeeded.pop(target, None)
        if decision is None:
            return False
        self._breakers.record(decision, failure=False)
        return True

    def tell_successes(self) -> None:
        """At the batch's end: one success per target (each failure was told as it happened)."""
        for target in list(self._succeeded):
            self.tell_success(target)
