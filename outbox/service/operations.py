"""Operations as every surface reads them: one by id, a page of them newest first, a cancel."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import and_, func, literal, or_, select
from sqlalchemy.orm import Session

from outbox.errors import InvalidIntent, NotFound, OperationNotFound
from outbox.ledger.clock import as_utc
from outbox.ledger.intent import require_storable
from outbox.ledger.models import Operation, Run
from outbox.ledger.states import Status
from outbox.ledger.submit import Receipt
from outbox.ledger.transitions import request_cancel
from outbox.ledger.typed_outcome import with_outcome
from outbox.reads.queries import detail_of, details_of, find_operation, submitted_detail

# Operation and run ids are UUIDs: anything else is not found, without asking the database.
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PAGE = 50
Owned = TypeVar("Owned", Operation, Run)


def owned(session: Session, model: type[Owned], tenant: str | None, record_id: str, missing: type[NotFound]) -> Owned:
    """The operation or run with this id if it is ``tenant``'s (None: any tenant's); ``missing``
    otherwise, the same whether it is another tenant's or nobody's."""
    found = session.get(model, record_id) if UUID.fullmatch(record_id) else None
    if found is None or (tenant is not None and found.tenant != tenant):
        raise missing(f"no {missing.what} {record_id}")
    return found


def get(session: Session, tenant: str | None, operation_id: str) -> Operation:
    """The operation with this id in ``tenant`` (None: any tenant)."""
    return owned(session, Operation, tenant, operation_id, OperationNotFound)


def find(session: Session, tenant: str | None, id_or_key: str) -> Operation:
    """By id, or by idempotency key within ``tenant`` (the command line's ID_OR_KEY; with no tenant
    the key must be unambiguous)."""
    return find_operation(session, id_or_key, tenant=tenant)


def answer(session: Session, op: Operation, *, replay: bool = False) -> dict[str, Any]:
    """The operation with its attempts, history and typed outcome, as agents read it (``replay``: the
    answer to a submit that found it, made by an earlier call: outbox/ledger/typed_outcome.py)."""
    return with_outcome(detail_of(session, op).as_json(), replay=replay)


def submitted(session: Session, receipt: Receipt) -> dict[str, Any]:
    """A submit's answer, as agents read operations: a new row from what its insert wrote and returned
    (no read; outbox.reads.queries.submitted_detail), an existing one read (a replay)."""
    if receipt.written is not None:
        return with_outcome(submitted_detail(*receipt.written).as_json())
    return answer(session, get(session, receipt.tenant, receipt.operation_id), replay=not receipt.new)


def answers(session: Session, operation_ids: Sequence[str], *, replay: bool = False) -> dict[str, dict[str, Any]]:
    """Several operations' answers in four reads whatever their number (a batch submit's replays)."""
    ops = list(session.execute(select(Operation).where(Operation.id.in_(list(operation_ids)))).scalars())
    return {d.operation.id: with_outcome(d.as_json(), replay=replay) for d in details_of(session, ops)}


def read(session: Session, tenant: str | None, operation_id: str) -> dict[str, Any]:
    return answer(session, get(session, tenant, operation_id))


@dataclass(frozen=True)
class Page:
    operations: list[Operation]
    next_cursor: str | None  # None: this was the last page


def page(
    session: Session,
    tenant: str | None,
    *,
    status: str | None = None,
    action: str | None = None,
    idempotency_key: str | None = None,
    search: str | None = None,
    cursor: str | None = None,
    limit: int = PAGE,
) -> Page:
    """Newest first, one page: keyset over (created_at, id), so a page is as quick at row 10,000,000
    as at row 1. ``search``: an operation id, or an idempotency key (exact, or its beginning)."""
    for name, text in (("action", action), ("idempotency_key", idempotency_key), ("q", search)):
        require_storable(name, text)
    if limit < 1:
        raise InvalidIntent("limit", "must be >= 1")
    stmt = select(Operation)
    if tenant is not None:
        stmt = stmt.where(Operation.tenant == tenant)
    if status is not None:
        if status not in {s.value for s in Status}:
            raise InvalidIntent("status", f"unknown status {status!r}; one of: " + ", ".join(s.value for s in Status))
        stmt = stmt.where(Operation.status == status)
    if action is not None:
        stmt = stmt.where(Operation.action == action)
    if idempotency_key is not None:
        stmt = stmt.where(Operation.idempotency_key == idempotency_key)
    if search:
        stmt = stmt.where(
            or_(
                Operation.id == search,
                Operation.idempotency_key == search,
                Operation.idempotency_key.startswith(search, autoescape=True),
            )
        )
    if cursor:
        created, last_id = decode_cursor(cursor)
        stmt = stmt.where(
            or_(Operation.created_at < created, and_(Operation.created_at == created, Operation.id < last_id))
        )
    stmt = stmt.order_by(Operation.created_at.desc(), Operation.id.desc()).limit(limit + 1)
    rows = list(session.execute(stmt).scalars())
    more = len(rows) > limit
    rows = rows[:limit]
    return Page(rows, encode_cursor(rows[-1]) if more and rows else None)


def encode_cursor(op: Operation) -> str:
    created = as_utc(op.created_at)
    raw = json.dumps([created.isoformat() if created else None, op.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        created, last_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not UUID.fullmatch(str(last_id)):
            raise ValueError("not an operation id")
        return dt.datetime.fromisoformat(created), str(last_id)
    except (ValueError, TypeError) as exc:
        raise InvalidIntent("cursor", "not a cursor this API returned (use next_cursor as it is)") from exc


# What a tenant's backlog counts: the operations the fleet still owes work, to send (not_dispatched,
# due or waiting) or to ask the provider about (outcome_unknown). Each is a range of a partial index.
BACKLOG = (Status.NOT_DISPATCHED, Status.OUTCOME_UNKNOWN)


def backlog(session: Session, tenant: str, *, up_to: int) -> int:
    """How many of ``tenant``'s operations the fleet still owes work (BACKLOG), counted up to ``up_to``
    per status: a bounded count, as quick with a million rows waiting as with a thousand."""
    total = 0
    for status in BACKLOG:
        rows = select(literal(1)).where(Operation.tenant == tenant, Operation.status == status.value).limit(up_to)
        total += session.scalar(select(func.count()).select_from(rows.subquery())) or 0
    return total


def key_taken(session: Session, tenant: str, idempotency_key: str) -> bool:
    """Whether ``tenant`` already has an operation under this idempotency key (a resubmit is a replay)."""
    found = select(Operation.id).where(Operation.tenant == tenant, Operation.idempotency_key == idempotency_key)
    return session.scalar(found.limit(1)) is not None


def cancel(session: Session, tenant: str | None, operation_id: str, *, actor: str, reason: str) -> Status:
    """Cancelled if nothing was sent yet; otherwise the request is recorded in the history and the
    operation ends as what really happened (outbox.ledger.transitions.request_cancel)."""
    op = get(session, tenant, operation_id)
    return request_cancel(session, op.id, actor=actor, reason=reason)
