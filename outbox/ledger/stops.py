"""Emergency stops: an operator holds every unsent intent of one subject (an agent) of one tenant.

``stop`` records who stopped it, when and why (``outbox_subject_stops``) and, in the same transaction,
holds every queued intent of the subject: not_dispatched -> not_dispatched, ``waiting_for = stopped``,
due only in ``HOLD_S`` (a bound no stop is meant to reach), so the relay rings none of them and no claim
loops over them. What was claimed before the stop, or comes back to the queue while it lasts (a retry,
a lookup that proves "not sent", an approval, a run's next step), is held at its claim by the workers,
which see the stop within a second (outbox/ledger/authority.py, workers/engine/authority.py); calls
already on the wire finish and settle as usual. New intents of the subject are refused at submit
(``refuse_if_stopped``: SubjectStopped), except a replay of one already accepted, answered as always.

``resume`` deletes the row and makes every held intent of the subject due at once. A worker's hold and
a resume cannot cross: the hold reads the stop row ``FOR SHARE`` in the transaction that holds the
operation (``still_stopped``), so a resume deleting it waits for that commit and its wake then sees
the held row; or the hold waits for the resume and finds no stop (SQLite: one writer at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import ColumnElement, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox.errors import SubjectStopped
from outbox.ledger.authority import Stop, board_for, snapshot_in
from outbox.ledger.clock import as_utc, db_now
from outbox.ledger.events import record_events
from outbox.ledger.models import Operation, core_table
from outbox.ledger.states import EventKind, Status, WaitingFor, check_allowed
from outbox.ledger.stop_models import SubjectStop

_OP = core_table(Operation)
_STOPS = core_table(SubjectStop)
# Held until resumed: a year is a bound no stop is meant to reach (a stop still there then holds it
# again at its claim), and far inside what the databases' interval arithmetic holds.
HOLD_S = 365 * 86400.0
# The moves a stop and a resume make; the state table must list them.
check_allowed("*", [Status.NOT_DISPATCHED], Status.NOT_DISPATCHED)


def held_reason(stop: Stop) -> str:
    return f"held: {stop.describe()}; nothing is sent until it is resumed (agent-outbox subjects resume)"


def stop(session: Session, *, tenant: str, subject: str, by: str, reason: str | None) -> tuple[Stop, bool, int]:
    """Stop ``subject`` of ``tenant``: (the stop, whether it is new, how many queued intents it held).
    Stopping a stopped subject keeps the first stop (who, when, why) and holds what has queued since."""
    new = False
    if session.execute(select(SubjectStop.tenant).where(_key(tenant, subject))).first() is None:
        try:
            with session.begin_nested():  # two operators at once: one stop, the other finds it
                session.execute(
                    insert(_STOPS).values(
                        tenant=tenant, subject=subject, stopped_by=by, stopped_at=db_now(), reason=reason
                    )
                )
            new = True
        except IntegrityError:
            pass
    held = Stop.of(session.execute(select(SubjectStop).where(_key(tenant, subject))).scalar_one())
    rows = session.execute(
        update(_OP)
        .where(
            _OP.c.tenant == tenant,
            _OP.c.subject == subject,
            _OP.c.status == Status.NOT_DISPATCHED.value,
            or_(_OP.c.waiting_for.is_(None), _OP.c.waiting_for != WaitingFor.STOPPED.value),  # not held yet
        )
        .values(
            next_attempt_at=db_now(HOLD_S),
            waiting_for=WaitingFor.STOPPED.value,
            reason=held_reason(held),
            updated_at=db_now(),
        )
        .returning(_OP.c.id, _OP.c.fencing_token)
    ).all()
    _moved(session, rows, EventKind.SUBJECT_STOPPED, held_reason(held), by)
    board_for(session).forget()
    return held, new, len(rows)


def resume(session: Session, *, tenant: str, subject: str, by: str) -> tuple[Stop | None, int]:
    """Lift the stop of ``subject`` of ``tenant``: (the stop lifted, None if there was none; how many
    held intents are due now). Held intents are woken even without a stop row (a resume run again
    after one that was interrupted finishes its work)."""
    gone = session.execute(
        delete(_STOPS)
        .where(_STOPS.c.tenant == tenant, _STOPS.c.subject == subject)
        .returning(_STOPS.c.tenant, _STOPS.c.subject, _STOPS.c.stopped_by, _STOPS.c.stopped_at, _STOPS.c.reason)
    ).first()
    lifted = None
    if gone is not None:
        at = as_utc(gone.stopped_at)
        assert at is not None
        lifted = Stop(gone.tenant, gone.subject, gone.stopped_by, at, gone.reason)
    why = f"resumed by {by}" + (f": {lifted.describe()} before" if lifted is not None else "")
    rows = session.execute(
        update(_OP)
        .where(
            _OP.c.tenant == tenant,
            _OP.c.subject == subject,
            _OP.c.status == Status.NOT_DISPATCHED.value,
            _OP.c.waiting_for == WaitingFor.STOPPED.value,
        )
        .values(next_attempt_at=db_now(), waiting_for=None, reason=why, updated_at=db_now())
        .returning(_OP.c.id, _OP.c.fencing_token)
    ).all()
    _moved(session, rows, EventKind.SUBJECT_RESUMED, why, by)
    board_for(session).forget()
    return lifted, len(rows)


def listing(session: Session, tenant: str | None = None) -> list[Stop]:
    """The stops in force (``tenant``: that tenant's only), oldest first."""
    stmt = select(SubjectStop).order_by(SubjectStop.stopped_at, SubjectStop.tenant, SubjectStop.subject)
    if tenant is not None:
        stmt = stmt.where(SubjectStop.tenant == tenant)
    return [Stop.of(row) for row in session.execute(stmt).scalars()]


def still_stopped(session: Session, tenant: str, subject: str) -> Stop | None:
    """The stop of ``subject``, read under a share lock for the rest of the caller's transaction (a
    worker about to hold one of its intents): a concurrent resume waits for this transaction."""
    found = session.execute(
        select(SubjectStop).where(_key(tenant, subject)).with_for_update(read=True)
    ).scalar_one_or_none()
    return Stop.of(found) if found is not None else None


def refuse_if_stopped(session: Session, *, tenant: str, subject: str, replay: Callable[[], bool]) -> None:
    """Raise SubjectStopped if ``subject`` of ``tenant`` is stopped (as this process last read it, at
    most a second ago), unless ``replay()`` says the intent was accepted before (it is answered as
    always: held, or done)."""
    found = snapshot_in(session).stop_of(tenant, subject)
    if found is None or replay():
        return
    raise SubjectStopped(
        f"Refused: {found.describe()}; no new {subject} intent is accepted until an operator resumes it. "
        "Nothing was submitted or sent. Do not retry: tell the user this action is on hold.",
        tenant=tenant,
        subject=subject,
        stopped_by=found.by,
        stopped_at=found.at.isoformat(),
        why=found.reason,
    )


def _key(tenant: str, subject: str) -> ColumnElement[bool]:
    return (SubjectStop.tenant == tenant) & (SubjectStop.subject == subject)


def _moved(session: Session, rows: Sequence[tuple[str, int]], event: EventKind, reason: str, actor: str) -> None:
    record_events(
        session,
        rows,
        from_status=Status.NOT_DISPATCHED,
        to=Status.NOT_DISPATCHED,
        kind=event,
        reason=reason,
        actor=actor,
    )
