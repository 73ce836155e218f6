"""Submit: write an intent into the outbox inside the caller's transaction.

The point of an outbox is that the agent's own rows and its intent commit or roll back together, so
``submit`` never commits: the caller does. Two concurrent submits of the same (tenant, key) produce
one row: ``INSERT ... ON CONFLICT DO NOTHING`` lets exactly one win, the loser reads the winner's
row and compares digests (same digest = the same intent, a different one = ``IdempotencyConflict``).
On PostgreSQL the insert also queues a NOTIFY that the database delivers on commit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from outbox.clock import db_now
from outbox.db import driver_connection, is_postgres
from outbox.envelope import build_envelope
from outbox.errors import IdempotencyConflict, InvalidIntent
from outbox.models import Operation, OperationEvent, core_table
from outbox.states import Status

NOTIFY_CHANNEL = "outbox_due"  # the relay LISTENs here; payload = operation id
MAX_KEY_LEN = 255

_OP = core_table(Operation)


@dataclass(frozen=True)
class Receipt:
    """What submit hands back to the agent runtime."""

    operation_id: str
    tenant: str
    idempotency_key: str
    status: str
    new: bool
    args_digest: str
    result_reference: str | None = None
    result: dict[str, Any] | None = None
    error_class: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id,
            "tenant": self.tenant,
            "idempotency_key": self.idempotency_key,
            "status": self.status,
            "new": self.new,
            "args_digest": self.args_digest,
            "result": (
                {"reference": self.result_reference, "response": self.result}
                if self.result_reference is not None or self.result is not None
                else None
            ),
            "error_class": self.error_class,
        }


def _validate_key(key: Any) -> str:
    if not isinstance(key, str) or not key.strip():
        raise InvalidIntent("idempotency_key", "required: a stable business key such as 'wf-81:invoice-17:refund-2:v1'")
    if key != key.strip() or len(key) > MAX_KEY_LEN:
        raise InvalidIntent("idempotency_key", f"must be 1-{MAX_KEY_LEN} characters without surrounding whitespace")
    return key


def submit(
    session: Session,
    *,
    tenant: str,
    idempotency_key: str,
    action: str,
    args: dict[str, Any],
    subject: str,
    run_id: str | None = None,
    tool_call_id: str | None = None,
    max_attempts: int | None = None,
    deadline_s: float | None = None,
    delay_s: float = 0.0,
    requires_approval: bool = False,
) -> Receipt:
    """Write one intent in the caller's transaction and return its receipt (never commits).

    ``max_attempts`` / ``deadline_s`` cap this intent's retry budget; None leaves it to the
    action's budget in the actions file. The tighter of the two applies.
    """
    key = _validate_key(idempotency_key)
    env = build_envelope(tenant=tenant, action=action, args=args, subject=subject)
    if max_attempts is not None and (
        not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1
    ):
        raise InvalidIntent("max_attempts", "must be an integer >= 1 (or None: the action's budget)")
    if deadline_s is not None and not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
        raise InvalidIntent("deadline_s", "must be a positive number of seconds (or None)")
    if not isinstance(delay_s, (int, float)) or delay_s < 0:
        raise InvalidIntent("delay_s", "must be >= 0")
    for name, ref in (("run_id", run_id), ("tool_call_id", tool_call_id)):
        if ref is not None and (not isinstance(ref, str) or len(ref) > 255):
            raise InvalidIntent(name, "must be a string of at most 255 characters")

    operation_id = str(uuid.uuid4())
    status = Status.AWAITING_APPROVAL if requires_approval else Status.NOT_DISPATCHED
    reason = f"subject {env.subject}" + (f", run {run_id}" if run_id else "")
    if is_postgres(session):
        params = {
            "id": operation_id,
            "tenant": env.tenant,
            "key": key,
            "action": env.action,
            "args": env.canonical_args,
            "digest": env.digest,
            "subject": env.subject,
            "run_id": run_id,
            "tool_call_id": tool_call_id,
            "status": status.value,
            "max_attempts": max_attempts,
            "deadline_s": None if deadline_s is None else float(deadline_s),
            "delay_s": float(delay_s),
            "reason": reason,
        }
        sql = _PG_SUBMIT_NOTIFY if status is Status.NOT_DISPATCHED else _PG_SUBMIT_QUIET
        inserted = bool(driver_connection(session).execute(sql, params).fetchone()[0])
    else:
        inserted = _insert_portable(
            session,
            dict(
                id=operation_id,
                tenant=env.tenant,
                idempotency_key=key,
                action=env.action,
                args=env.canonical_args,
                args_digest=env.digest,
                subject=env.subject,
                run_id=run_id,
                tool_call_id=tool_call_id,
                status=status.value,
                reason="submitted",
                fencing_token=0,
                attempt_count=0,
                max_attempts=max_attempts,
                deadline_at=db_now(deadline_s) if deadline_s is not None else None,
                next_attempt_at=db_now(delay_s),
                cancel_requested=False,
                proven_absent_through=0,
                created_at=db_now(),
                updated_at=db_now(),
            ),
            dict(
                operation_id=operation_id,
                at=db_now(),
                from_status=None,
                to_status=status.value,
                fencing_token=0,
                event="submit",
                reason=reason,
                actor=env.subject,
            ),
        )
    if inserted:
        return Receipt(operation_id, env.tenant, key, status.value, True, env.digest)

    existing = session.execute(
        select(
            _OP.c.id, _OP.c.status, _OP.c.args_digest, _OP.c.result_reference, _OP.c.result, _OP.c.error_class
        ).where(_OP.c.tenant == env.tenant, _OP.c.idempotency_key == key)
    ).one()
    if existing.args_digest != env.digest:
        raise IdempotencyConflict(key, existing.args_digest, env.digest, existing.id)
    return Receipt(
        existing.id,
        env.tenant,
        key,
        existing.status,
        False,
        existing.args_digest,
        existing.result_reference,
        existing.result,
        existing.error_class,
    )


# PostgreSQL: intent row, its event row and the NOTIFY in ONE statement (one round trip). Plain
# SQL sent through the driver: building and compiling the equivalent Core construct on every
# submit cost about 2 ms of client CPU, several times what PostgreSQL spent (bench/README.md).
# The event and the notification come only from a row this statement inserted (ON CONFLICT DO
# NOTHING inserts none for a replay); the NOTIFY is delivered when the caller commits.
_PG_SUBMIT = """
WITH ins AS (
    INSERT INTO operations (id, tenant, idempotency_key, action, args, args_digest, subject, run_id,
        tool_call_id, status, reason, fencing_token, attempt_count, max_attempts, deadline_at,
        next_attempt_at, cancel_requested, proven_absent_through, created_at, updated_at)
    VALUES (%(id)s, %(tenant)s, %(key)s, %(action)s, %(args)s, %(digest)s, %(subject)s, %(run_id)s,
        %(tool_call_id)s, %(status)s, 'submitted', 0, 0, %(max_attempts)s,
        clock_timestamp() + make_interval(secs => %(deadline_s)s::float8),  -- NULL: no deadline
        clock_timestamp() + make_interval(secs => %(delay_s)s::float8),
        false, 0, clock_timestamp(), clock_timestamp())
    ON CONFLICT (tenant, idempotency_key) DO NOTHING
    RETURNING id
), logged AS (
    INSERT INTO operation_events (operation_id, at, from_status, to_status, fencing_token, event, reason, actor)
    SELECT id, clock_timestamp(), NULL, %(status)s, 0, 'submit', %(reason)s, %(subject)s FROM ins
)
SELECT (SELECT count(*) FROM ins){notify}
"""
_PG_SUBMIT_NOTIFY = _PG_SUBMIT.format(notify=f", (SELECT count(pg_notify('{NOTIFY_CHANNEL}', id)) FROM ins)")
_PG_SUBMIT_QUIET = _PG_SUBMIT.format(notify="")


def _insert_portable(session: Session, values: dict[str, Any], event: dict[str, Any]) -> bool:
    """SQLite: the intent row, then (only if this call inserted it) its event row."""
    inserted = (
        session.execute(
            sqlite_insert(_OP)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[_OP.c.tenant, _OP.c.idempotency_key])
            .returning(_OP.c.id)
        ).first()
        is not None
    )
    if inserted:
        session.execute(insert(OperationEvent).values(**event))
    return inserted
