"""Failpoints: crash or stall a process between two lines, for fault tests (never set in production).

``OUTBOX_FAILPOINTS`` is a comma-separated list of ``name=action``; ``action`` is ``exit`` (the
process dies with ``os._exit(137)``, as after a SIGKILL: no cleanup, no finally blocks) or
``sleep:SECONDS``. A name may carry ``@KEYGLOB`` to fire only for matching idempotency keys:
``dispatch.after_response=exit@poison-*``.

In-process tests can also run a function at a failpoint (``on(name, fn)``): that is how a test
completes or re-claims a row between a maintenance loop's read and its write.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

# Where dispatch can be cut: after the claim committed; after every check, as the request is
# about to leave (a worker frozen here sends later, whatever the budget says by then); after the
# provider answered, before the result was written back.
# Every maintenance loop that reads rows and then writes them can be cut between the two: its
# write must re-check what it read (state and token) and touch nothing that moved meanwhile.
NAMES = (
    "dispatch.after_claim",
    "dispatch.before_send",
    "dispatch.after_response",
    "reconcile.after_lookup",
    "sweep.after_select_before_update",  # lease expiry (outbox/ledger/leases.py)
    "late_evidence.after_select_before_update",  # applying stale successes (outbox/evidence/late_successes.py)
    "gate.after_select_before_update",  # parking for an open breaker (workers/dispatch/gate.py)
    "backfill.after_select_before_update",  # writing evidence the sink missed (outbox/evidence/sinks.py)
)
_HOOKS: dict[str, Callable[[str | None], None]] = {}


@contextmanager
def on(name: str, fn: Callable[[str | None], None]) -> Iterator[None]:
    """Run ``fn(key)`` the first time this process hits ``name`` (tests only). Once: ``fn`` may run
    the same loop itself (another sweep), which must not cut it again."""
    if name not in NAMES:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(NAMES)}")
    _HOOKS[name] = fn
    try:
        yield
    finally:
        _HOOKS.pop(name, None)


def _parse(spec: str) -> list[tuple[str, str, str]]:
    points = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = item.partition("=")
        action, _, glob = action.partition("@")
        if name not in NAMES:
            raise ValueError(f"OUTBOX_FAILPOINTS: unknown failpoint {name!r}; known: {', '.join(NAMES)}")
        points.append((name, action or "exit", glob or "*"))
    return points


def hit(name: str, key: str | None = None) -> None:
    hook = _HOOKS.pop(name, None)
    if hook is not None:
        hook(key)
    spec = os.environ.get("OUTBOX_FAILPOINTS")
    if not spec:
        return
    for point, action, glob in _parse(spec):
        if point != name or not fnmatch.fnmatchcase(key or "", glob):
            continue
        log.warning("failpoint %s: %s", name, action)
        if action == "exit":
            os._exit(137)
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
