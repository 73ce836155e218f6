"""What a move writes, as data: one definition that both ledger drivers render.

A move's guard says *whether* a row may change (effect_guard.py, the state table); its write set
says *what* changes. The write sets are spelled here once, as (column, value) pairs whose values
are either a named parameter or one of a few database-side expressions (``Db``). The PostgreSQL
driver renders them into its catalogue's statement text, the SQLite driver into Core values, and
the moves written with ``transitions.move`` (settlements, late evidence, lease expiry) take them
as Core values (``success_values``, ``released``): a new column written on success is added here
and reaches every path that records a provider's success. (A person's "succeeded" records only the
reference they found: nothing else of the provider's answer is known then.)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, null

from outbox.ledger.clock import db_now
from outbox.ledger.request_record import RECORD_COLUMNS, RECORD_PARAMS
from outbox.ledger.states import EFFECT, TERMINAL, Status, WaitingFor


class Db(enum.Enum):
    """A value the database computes (never a worker's clock)."""

    NULL = "null"
    NOW = "now"  # the database's clock
    NOW_PLUS_DELAY = "now + delay_s"  # the database's clock plus the ``delay_s`` parameter
    DECREMENT = "column - 1"
    # The ``reason`` parameter, noting a cancel that was asked for while the request was out: the
    # flag is read in the same statement, so a cancel that arrived mid-flight is never left unsaid.
    REASON_NOTING_CANCEL = "reason (completed after cancel requested)"


CANCEL_NOTE = " (completed after cancel requested)"


@dataclass(frozen=True)
class Param:
    """The value of the named parameter."""

    name: str
    cast: str | None = None  # a type the parameter is sent as (PostgreSQL text: json)


@dataclass(frozen=True)
class IfNull:
    """The named parameter where the column ``unless`` IS NULL, else the column as it is: a value
    written once and kept (the request on record under a key: outbox/ledger/request_record.py)."""

    name: str
    unless: str


Value = Param | Db | IfNull
WriteSet = tuple[tuple[str, Value], ...]

# An attempt's report, written once to its row.
ATTEMPT_REPORT: WriteSet = (
    ("ended_at", Db.NOW),
    ("attempt_class", Param("klass")),
    ("status_code", Param("status_code")),
    ("request_digest", Param("request_digest")),
    ("provider_request_id", Param("provider_request_id")),
    ("provider_reference", Param("provider_reference")),
    ("response_digest", Param("response_digest")),
    ("retry_after_s", Param("retry_after_s")),
    ("latency_s", Param("latency_s")),
    ("error", Param("error")),
    ("stale", Param("stale")),
)

# What a recorded success writes on the operation: the provider's reference and response.
SUCCESS: WriteSet = (
    ("result_reference", Param("provider_reference")),
    ("result_digest", Param("response_digest")),
    ("result", Param("result", cast="json")),
    ("error_class", Db.NULL),
)

# What a recorded non-success writes: the class and error of the attempt that decided it.
NOT_SUCCESS: WriteSet = (
    ("error_class", Param("klass")),
    ("last_error", Param("error")),
)

RELEASE_LEASE: WriteSet = (("lease_owner", Db.NULL), ("lease_expires_at", Db.NULL))

# The first request that left under the key, recorded by the finalize of its attempt and never
# overwritten (all of it or none: the guard is request_version); with the version it was built
# under, which an operation that recorded none at submit takes too. An attempt that did not leave
# passes NULLs, which change nothing.
RECORD_FIRST: WriteSet = (
    *((column, IfNull(param, unless="request_version")) for column, param in zip(RECORD_COLUMNS, RECORD_PARAMS)),
    ("action_version", IfNull("sent_version", unless="action_version")),
)


def finalize_writes(to: Status, *, refund: bool) -> WriteSet:
    """What a worker's fenced finalize writes on the operation when it moves it to ``to``."""
    writes: list[tuple[str, Value]] = [
        ("status", Param("to")),
        ("updated_at", Db.NOW),
        ("reason", Db.REASON_NOTING_CANCEL if to in EFFECT else Param("reason")),
        ("waiting_for", Param("waiting_for")),
        *RELEASE_LEASE,
        # Accepted keeps the provider's reference and answer while the provider finishes.
        *(SUCCESS if to in EFFECT or to is Status.ACCEPTED else NOT_SUCCESS),
        *RECORD_FIRST,
    ]
    if to in (Status.NOT_DISPATCHED, Status.OUTCOME_UNKNOWN, Status.ACCEPTED):
        writes.append(("next_attempt_at", Db.NOW_PLUS_DELAY))
    if refund:
        writes.append(("attempt_count", Db.DECREMENT))
    if to in TERMINAL:
        writes.append(("finished_at", Db.NOW))
    return tuple(writes)


def settle_writes(to: Status) -> WriteSet:
    """What a reconciler's fenced settlement writes on the operation (outcome_unknown or accepted -> ``to``):
    the lease released, the provider's answer on a success, the next lookup or dispatch time. Not
    the error columns: they keep the dispatch attempt's error, which the lookup only explains."""
    if to not in SETTLE_WRITES_FOR:
        raise ValueError(f"no settlement write set for {to.value}")
    writes: list[tuple[str, Value]] = [
        ("status", Param("to")),
        ("updated_at", Db.NOW),
        ("reason", Param("reason")),
        ("waiting_for", Param("waiting_for")),
        *RELEASE_LEASE,
    ]
    if to in EFFECT:
        writes.extend(SUCCESS)
    else:
        if to is Status.ACCEPTED:
            writes.extend(SUCCESS)
        writes.append(("next_attempt_at", Db.NOW_PLUS_DELAY))
    if to in TERMINAL:
        writes.append(("finished_at", Db.NOW))
    return tuple(writes)


# The settlements written in one statement (settlement.settle_many_if_fenced): those without a
# guard, a handoff or a value computed from other rows.
SETTLE_WRITES_FOR = frozenset(
    {
        Status.SUCCEEDED,
        Status.COMMITTED_EVIDENCE_DEGRADED,
        Status.NOT_DISPATCHED,
        Status.OUTCOME_UNKNOWN,
        Status.ACCEPTED,
    }
)


def waiting_on_entry(to: Status, scheduled: WaitingFor | None = None) -> WaitingFor | None:
    """What an operation moved to ``to`` waits for: a lookup in outcome_unknown, a person in
    awaiting_approval; in not_dispatched what the move scheduled (None: due now); in
    reconciliation_required what the person is asked for, if the move says (credentials, a
    decision); else nothing."""
    if to is Status.OUTCOME_UNKNOWN:
        return WaitingFor.LOOKUP
    if to is Status.ACCEPTED:
        return WaitingFor.PROVIDER
    if to is Status.AWAITING_APPROVAL:
        return WaitingFor.APPROVAL
    return scheduled if to in (Status.NOT_DISPATCHED, Status.RECONCILIATION_REQUIRED) else None


def core_values(writes: WriteSet, params: Mapping[str, Any], table: Any) -> dict[str, Any]:
    """A write set as SQLAlchemy Core values for an UPDATE of ``table``."""
    values: dict[str, Any] = {}
    for column, value in writes:
        if isinstance(value, Param):
            # A JSON parameter of None is SQL NULL, as PostgreSQL's CAST(NULL AS json), not JSON null.
            none_is_null = value.cast == "json" and params[value.name] is None
            values[column] = null() if none_is_null else params[value.name]
        elif isinstance(value, IfNull):
            values[column] = case((table.c[value.unless].is_(None), params[value.name]), else_=table.c[column])
        elif value is Db.NULL:
            values[column] = None
        elif value is Db.NOW:
            values[column] = db_now()
        elif value is Db.NOW_PLUS_DELAY:
            values[column] = db_now(max(float(params["delay_s"]), 0.0))
        elif value is Db.REASON_NOTING_CANCEL:
            reason = params["reason"]
            values[column] = case((table.c.cancel_requested, reason + CANCEL_NOTE), else_=reason)
        else:
            values[column] = table.c[column] - 1
    return values


def success_values(reference: str | None, digest: str | None, result: Mapping[str, Any] | None) -> dict[str, Any]:
    """SUCCESS as Core values, for a move written with Core (a settlement, a late success)."""
    return core_values(SUCCESS, {"provider_reference": reference, "response_digest": digest, "result": result}, None)


def released() -> dict[str, Any]:
    """RELEASE_LEASE as Core values."""
    return core_values(RELEASE_LEASE, {}, None)
