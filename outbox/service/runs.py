"""Runs as every surface reads, cancels and resolves them, for one tenant (the ledger's moves are
outbox/runs/lifecycle.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from outbox.errors import RunNotFound
from outbox.ledger.models import Run
from outbox.runs import lifecycle
from outbox.service.operations import owned

LIMIT = 100


def get(session: Session, tenant: str | None, run_id: str) -> Run:
    """The run with this id in ``tenant`` (None: any tenant)."""
    return owned(session, Run, tenant, run_id, RunNotFound)


def find(session: Session, tenant: str | None, id_or_key: str) -> Run:
    """By run id, or by run key within ``tenant`` (the command line's RUN)."""
    return lifecycle.find_run(session, id_or_key, tenant=tenant)


def read(session: Session, tenant: str | None, run_id: str) -> dict[str, Any]:
    """The run as every surface shows it (outbox.runs.lifecycle.run_json)."""
    return lifecycle.run_json(session, get(session, tenant, run_id))


def listing(session: Session, tenant: str | None, *, status: str | None = None, limit: int = LIMIT) -> list[Run]:
    """Runs, newest first."""
    return lifecycle.list_runs(session, status=status, tenant=tenant, limit=limit)


def cancel(
    session: Session,
    tenant: str | None,
    run_id: str,
    *,
    actor: str,
    compensate: bool,
    reason: str,
    irreversible: frozenset[str] = frozenset(),
) -> Run:
    """Cancel future steps (a step in flight keeps its late result); ``compensate``: also undo
    completed steps, in reverse order. ``irreversible``: the actions file's irreversible actions."""
    return lifecycle.cancel_run(
        session,
        get(session, tenant, run_id),
        actor=actor,
        compensate=compensate,
        reason=reason,
        irreversible=irreversible,
    )


def resolve(session: Session, tenant: str | None, run_id: str, *, actor: str, note: str) -> Run:
    """A person closes a run that waits for one, saying what they did."""
    return lifecycle.resolve_run(session, get(session, tenant, run_id), actor=actor, note=note)
