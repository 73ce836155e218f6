"""The states of a run (DESIGN.md, "Runs"): what each means, and which are still moving.

A run's steps are operations with their own state machine (states.py); a run's state says where the
sequence as a whole stands. The advance (outbox/runs/advance.py) is the only writer of these moves;
``runs cancel`` and ``runs resolve`` ask for them.
"""

from __future__ import annotations

import enum


class RunStatus(str, enum.Enum):
    RUNNING = "running"
    COMPENSATING = "compensating"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATED = "compensated"
    CANCELLED = "cancelled"
    NEEDS_PERSON = "needs_person"
    RESOLVED = "resolved"

    def __str__(self) -> str:
        return self.value


RUN_MEANING: dict[RunStatus, str] = {
    RunStatus.RUNNING: "steps run in order; the holding step says which one it waits for and why",
    RunStatus.COMPENSATING: "a step failed: completed steps are being undone in reverse order by their compensations",
    RunStatus.SUCCEEDED: "every step succeeded",
    RunStatus.FAILED: "a step failed (or the budget ran out) and no effect of the run remains: nothing else was done",
    RunStatus.COMPENSATED: "a step failed; every completed step was undone by its compensation",
    RunStatus.CANCELLED: "cancelled: later steps were never sent; completed steps are listed (kept unless compensated)",
    RunStatus.NEEDS_PERSON: (
        "effects remain that automation will not undo (an irreversible step, a step without compensation, a "
        "failed compensation, a spent budget): a person decides"
    ),
    RunStatus.RESOLVED: "a person took the run over and closed it (see the note)",
}

ACTIVE: frozenset[RunStatus] = frozenset({RunStatus.RUNNING, RunStatus.COMPENSATING})
