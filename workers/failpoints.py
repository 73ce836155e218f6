"""Failpoints: crash or stall a worker between two lines, for fault tests (never set in production).

``OUTBOX_FAILPOINTS`` is a comma-separated list of ``name=action``; ``action`` is ``exit`` (the
process dies with ``os._exit(137)``, as after a SIGKILL: no cleanup, no finally blocks) or
``sleep:SECONDS``. A name may carry ``@KEYGLOB`` to fire only for matching idempotency keys:
``dispatch.after_response=exit@poison-*``.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time

log = logging.getLogger(__name__)

# Where dispatch can be cut: after the claim committed; after every check, as the request is
# about to leave (a worker frozen here sends later, whatever the budget says by then); after the
# provider answered, before the result was written back.
NAMES = ("dispatch.after_claim", "dispatch.before_send", "dispatch.after_response", "reconcile.after_lookup")


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
