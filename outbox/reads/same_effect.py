"""Possible duplicates by business object: the source articles' main bug, seen from the ledger.

A caller that mints a new idempotency key on every retry makes two operations of one intent: two
refunds of one order under two keys, each succeeded, each with its own provider document. No key
comparison finds that (each key has one document); only the business object does. So, per action,
operations with different keys on the same object, both succeeded, created within ``window_s`` of
each other, are listed as *possible* duplicates: a person decides (two partial refunds of one order
may be meant: an agent's ``occurrence``, a workflow's second refund).

The object is the action's ``object`` template as rendered at submit (``operations.object_key``:
outbox/ledger/objects.py), or, where the action declares ``report.same_effect_when`` (a list of its
arguments), the values of those arguments (read from the stored arguments: operations whose
arguments were purged by retention cannot be compared, and are left out). A finding names the
operations, their keys and references, never argument values: an ``object`` key is shown as stored,
a ``same_effect_when`` identity as the argument names and a digest of their values.

Read over operations created since ``since`` minus the window (a pair straddling the window's start
is found), kept when one of them was created since ``since``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.ledger.clock import as_utc
from outbox.ledger.envelope import dumps_canonical, loads_exact
from outbox.ledger.models import Operation
from outbox.ledger.states import Status

# Both must hold the effect as done (a duplicate is two effects).
EFFECT_STATUSES = (Status.SUCCEEDED.value, Status.COMMITTED_EVIDENCE_DEGRADED.value)
# The default window (OUTBOX_REPORT_SAME_OBJECT_WINDOW_S, ``report --same-object-window``): a caller's
# retries come within seconds to hours; a day catches a retry after an overnight outage and leaves
# alone the next month's refund of the same order.
DEFAULT_WINDOW_S = 86400.0
# How the object of an action is named: its ``object`` template, or the arguments it declares.
BY_OBJECT = "object"
BY_ARGS = "same_effect_when"


def possible_duplicates(
    session: Session, *, rules: Mapping[str, Sequence[str] | None], since: dt.datetime, window_s: float
) -> list[dict[str, Any]]:
    """``rules``: per action, its ``report.same_effect_when`` arguments, or None for its ``object``
    template. One finding per group of two or more operations (the module docstring)."""
    if not rules:
        return []
    start = since - dt.timedelta(seconds=window_s)
    rows = session.execute(
        select(
            Operation.id,
            Operation.tenant,
            Operation.action,
            Operation.idempotency_key,
            Operation.status,
            Operation.result_reference,
            Operation.object_key,
            Operation.args,
            Operation.created_at,
        )
        .where(
            Operation.action.in_(list(rules)),
            Operation.status.in_(EFFECT_STATUSES),
            Operation.created_at >= start,
        )
        .order_by(Operation.created_at, Operation.id)
    ).all()
    groups: dict[tuple[str, str, str], list[Any]] = defaultdict(list)
    for row in rows:
        identity = _identity(row, rules[row.action])
        if identity is not None:
            groups[(row.tenant, row.action, identity)].append(row)
    out = []
    for (tenant, action, identity), members in sorted(groups.items()):
        for cluster in _within(members, window_s):
            if len(cluster) > 1 and any(_at(r) >= since for r in cluster):
                out.append(_finding(tenant, action, identity, rules[action], window_s, cluster))
    return out


def _identity(row: Any, same_effect_when: Sequence[str] | None) -> str | None:
    if same_effect_when is None:
        key: str | None = row.object_key  # None: no object was rendered for it (an older row)
        return key
    if row.args is None:
        return None  # purged: nothing left to compare
    args = loads_exact(row.args)
    values = [args.get(name) for name in same_effect_when]
    if all(v is None for v in values):
        return None
    digest = hashlib.sha256(dumps_canonical(values).encode()).hexdigest()[:16]
    return f"{', '.join(same_effect_when)} (sha256:{digest})"


def _at(row: Any) -> dt.datetime:
    at = as_utc(row.created_at)
    assert at is not None
    return at


def _within(members: list[Any], window_s: float) -> list[list[Any]]:
    """Members (oldest first) in runs where each was created within ``window_s`` of the one before."""
    runs: list[list[Any]] = []
    for row in members:
        if runs and (_at(row) - _at(runs[-1][-1])).total_seconds() <= window_s:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def _finding(
    tenant: str, action: str, identity: str, same_effect_when: Sequence[str] | None, window_s: float, rows: list[Any]
) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "action": action,
        "object": identity,
        "by": BY_OBJECT if same_effect_when is None else BY_ARGS,
        "window_s": window_s,
        "count": len(rows),
        "operations": [
            {
                "operation_id": r.id,
                "idempotency_key": r.idempotency_key,
                "status": r.status,
                "reference": r.result_reference,
                "created_at": _at(r).isoformat(),
            }
            for r in rows
        ],
    }
