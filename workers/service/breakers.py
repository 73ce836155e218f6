"""The targets' circuit breakers as operators read and reset them, from any surface, beside the
limits each target declares and what the fleet admits under them now.

A reset closes the breaker in Redis (every worker sees it on its next call) and makes due now the
operations the breaker had parked until its reopen time, so they do not sit out a reset timeout the
operator just cancelled. Both are recorded with who and when: the breaker's hash (reset_by,
reset_at_ms), a WARNING log line, and one ledger event per released operation.

Without OUTBOX_REDIS_URL every worker keeps its breakers in its own memory: no other process can
see them or reset them, so ``board`` says so (``shared`` False) and ``reset_and_wake`` refuses.
Targets are shared by every tenant: a reset is an operator's act, for everyone's operations.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from breaker import reset as reset_breaker
from breaker import status as breaker_status
from outbox.errors import NotFound, OutboxError
from outbox.ledger.waits import wake_breaker_waits
from outbox.service.inputs import BY_MAX, written
from outbox.settings import Settings
from workers.pacing import limits_of
from workers.wiring.builders import breaker_registry, load_actions_for, pacer_for

# How a surface opens the ledger for the wake, only once the reset is done: the server passes its
# open sessionmaker (``opened(sessions)``), the command line opens the configured ledger then.
Ledger = Callable[[], AbstractContextManager[sessionmaker[Session]]]

LOCAL_NOTE = (
    "breakers are process-local: OUTBOX_REDIS_URL is not set, so each worker keeps its breakers "
    "in its own memory and this command cannot see (or reset) them; set OUTBOX_REDIS_URL to share them"
)


class TargetNotFound(NotFound):
    """The actions file declares no target of that name."""

    what = "target"

    def __init__(self, target: str, known: list[str]) -> None:
        super().__init__(f"unknown target {target!r}; known targets: {', '.join(known) or '(none)'}")
        self.target, self.known = target, known


class LocalBreakers(OutboxError):
    """Breakers are per process (no shared storage): nobody else can reset them."""


class NotWoken(OutboxError):
    """The breaker was reset, but the operations it parked could not be made due: they run at their
    reopen time."""


@dataclass(frozen=True)
class BreakerRow:
    target: str
    state: str | None  # None: per process, this process cannot see it
    failures: int | None
    fail_max: int
    reset_timeout_s: float
    opened_at: str | None
    reopens_at: str | None
    # The limits the target declares ("50/s (burst 20); 8 in flight"; None: none), and what the fleet
    # admits now: calls in the last whole second and calls holding a concurrency slot (None: the
    # limits are per process, or Redis could not be read).
    limits: str | None = None
    admitted_last_s: int | None = None
    in_flight: int | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Board:
    namespace: str
    shared: bool
    breakers: list[BreakerRow]


@dataclass(frozen=True)
class Reset:
    target: str
    by: str
    at: dt.datetime
    woken: int  # parked operations made due now


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def board(settings: Settings) -> Board:
    """Every target of the actions file: state, failures, opened at, reopens at (states None when
    the breakers are per process). Raises breaker.errors.BreakerStorageUnavailable when Redis cannot
    be read."""
    actions = load_actions_for(settings)
    registry = breaker_registry(settings, actions)
    targets = sorted(registry.configs)
    registry.close()  # only its configuration is needed: the states are read from Redis
    found = {}
    if registry.redis_url:
        found = {st.target: st for st in breaker_status(registry.redis_url, targets, registry.namespace)}
    declared = limits_of(actions)
    # One cheap read per limited target (a per-second counter and a slot count), same namespace.
    pacer = pacer_for(settings, actions, "console")
    readings = {target: pacer.reading(target) for target in declared}
    pacer.close()
    rows = []
    for target in targets:
        st, config, reading = found.get(target), registry.configs[target], readings.get(target)
        rows.append(
            BreakerRow(
                target=target,
                state=st.state if st else None,
                failures=st.failures if st else None,
                fail_max=config.fail_max,
                reset_timeout_s=config.reset_timeout_s,
                opened_at=_iso(st.opened_at) if st else None,
                reopens_at=_iso(st.reopens_at) if st else None,
                limits=declared[target].describe() if target in declared else None,
                admitted_last_s=reading.admitted_last_s if reading else None,
                in_flight=reading.in_flight if reading else None,
            )
        )
    return Board(registry.namespace, bool(registry.redis_url), rows)


def opened(sessions: sessionmaker[Session]) -> Ledger:
    return lambda: nullcontext(sessions)


def reset_and_wake(settings: Settings, ledger: Ledger, target: str, *, by: str) -> Reset:
    """Close ``target``'s breaker in every process, then make due the operations it parked.

    Only rows the breaker parked (waiting_for = breaker) and that are not yet due are woken: a retry
    scheduled by backoff or Retry-After keeps its time. One event per row records who."""
    written("--by", by, max_len=BY_MAX, required=True)
    actions = load_actions_for(settings)
    registry = breaker_registry(settings, actions)
    registry.close()  # only its configuration is needed: the reset goes to Redis itself
    if target not in registry.configs:
        raise TargetNotFound(target, sorted(registry.configs))
    if not registry.redis_url:
        raise LocalBreakers(f"cannot reset: {LOCAL_NOTE}")
    reset_breaker(registry.redis_url, target, by=by, namespace=registry.namespace)
    at = dt.datetime.now().astimezone()
    names = sorted(name for name, a in actions.actions.items() if a.target == target)
    woken = 0
    if names:
        try:
            with ledger() as sessions, sessions.begin() as session:
                woken = len(wake_breaker_waits(session, names, reason=f"breaker for {target} reset by {by}", actor=by))
        except Exception as exc:  # noqa: BLE001 - the reset itself is done; say what was not
            raise NotWoken(
                f"the breaker is closed, but parked operations could not be made due ({exc}); "
                "they run at their reopen time"
            ) from exc
    return Reset(target, by, at, woken)
