"""Retention: terminal operations keep their story, not their payload.

``purge`` removes the arguments and the provider's response of terminal operations (succeeded,
failed_before_commit, cancelled) that finished more than ``older_than_s`` ago, in batches, each
batch its own transaction. What stays: states, digests (arguments, result), provider references,
attempts (their redacted error texts included), the history, evidence records and handoffs (their
packets lose the intent's arguments too). Of the request on record under the key (outbox/ledger/request_record.py)
its body and path go (built from the arguments); its method, digest and version stay. Finished runs lose their steps' arguments the same way, and
a purged operation's hold on its business object (outbox/ledger/objects.py) is dropped. A purged operation cannot be sent again: if late evidence
ever reopens one and a person says "not executed", dispatch refuses it (no arguments to send).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import and_, null, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import ConfigError
from outbox.ledger.clock import db_now
from outbox.ledger.models import Handoff, Operation, Run
from outbox.ledger.objects import release_finished
from outbox.ledger.run_states import ACTIVE, RunStatus
from outbox.ledger.states import TERMINAL

BATCH = 500
PURGED = "purged"  # what a handoff packet's intent.args says once purged


@dataclass
class PurgeResult:
    operations: int = 0
    handoffs: int = 0
    runs: int = 0
    oldest_finished_at: dt.datetime | None = None
    newest_finished_at: dt.datetime | None = None

    def as_dict(self, *, dry_run: bool, older_than_s: float) -> dict[str, object]:
        return {
            "dry_run": dry_run,
            "older_than_s": older_than_s,
            "operations": self.operations,
            "handoffs": self.handoffs,
            "runs": self.runs,
            "oldest_finished_at": self.oldest_finished_at.isoformat() if self.oldest_finished_at else None,
            "newest_finished_at": self.newest_finished_at.isoformat() if self.newest_finished_at else None,
        }


def check_retention(args_retention_s: float, key_retentions: Iterable[tuple[str, float]]) -> None:
    """Refuse a retention shorter than a provider's key retention (name, retention_s)."""
    longest = max(key_retentions, key=lambda nr: nr[1], default=None)
    if longest is not None and args_retention_s < longest[1]:
        raise ConfigError(
            f"OUTBOX_ARGS_RETENTION_S={args_retention_s:g} is shorter than "
            f"actions.{longest[0]}.provider_idempotency.retention_s={longest[1]:g}: arguments would be "
            f"purged while the provider still answers for their key; set OUTBOX_ARGS_RETENTION_S >= {longest[1]:g}"
        )


def _due(older_than_s: float):  # type: ignore[no-untyped-def]
    return and_(
        Operation.status.in_([s.value for s in TERMINAL]),
        Operation.finished_at < db_now(-older_than_s),
        or_(Operation.args.is_not(None), Operation.result.is_not(None)),
    )


def purge(
    sessions: sessionmaker[Session],
    *,
    older_than_s: float,
    dry_run: bool = False,
    progress: Callable[[PurgeResult], None] | None = None,
) -> PurgeResult:
    out = PurgeResult()
    while True:
        with sessions.begin() as session:
            rows = session.execute(
                select(Operation.id, Operation.finished_at)
                .where(_due(older_than_s))
                .order_by(Operation.finished_at, Operation.id)
                .limit(BATCH)
                .offset(out.operations if dry_run else 0)
            ).all()
            if not rows:
                break
            ids = [r.id for r in rows]
            out.operations += len(ids)
            out.oldest_finished_at = out.oldest_finished_at or rows[0].finished_at
            out.newest_finished_at = rows[-1].finished_at
            handoffs = list(session.execute(select(Handoff).where(Handoff.operation_id.in_(ids))).scalars())
            out.handoffs += len(handoffs)
            if not dry_run:
                done = session.execute(
                    update(Operation)
                    .where(Operation.id.in_(ids), _due(older_than_s))
                    # SQL NULL, not JSON null; the request on record goes with the arguments it was built from.
                    .values(args=None, result=null(), request_body=None, request_path=None)
                )
                if not done.rowcount:  # type: ignore[attr-defined]
                    break  # nothing changed: never loop on rows we cannot purge
                release_finished(session, ids)
                for h in handoffs:
                    packet = dict(h.packet or {})
                    packet["intent"] = {**(packet.get("intent") or {}), "args": PURGED}
                    sent = (packet.get("request") or {}).get("sent")
                    if sent:  # the request on record: its path and body hold argument values
                        packet["request"] = {**packet["request"], "sent": {**sent, "path": PURGED, "body": PURGED}}
                    h.packet = packet
        if progress is not None:
            progress(out)
    return _purge_runs(sessions, out, older_than_s=older_than_s, dry_run=dry_run)


def _purge_runs(
    sessions: sessionmaker[Session], out: PurgeResult, *, older_than_s: float, dry_run: bool
) -> PurgeResult:
    """Finished runs lose their steps' arguments (names, actions, digests and keys stay)."""
    due = and_(
        # Not a run a person still has to act on (needs_person may be compensated from its arguments).
        Run.status.not_in([*(s.value for s in ACTIVE), RunStatus.NEEDS_PERSON.value]),
        Run.finished_at < db_now(-older_than_s),
        Run.purged_at.is_(None),
    )
    while True:
        with sessions.begin() as session:
            stmt = select(Run).where(due).order_by(Run.finished_at, Run.id).limit(BATCH)
            runs = list(session.execute(stmt.offset(out.runs if dry_run else 0)).scalars())
            if not runs:
                return out
            out.runs += len(runs)
            if not dry_run:
                now = session.execute(select(db_now())).scalar_one()
                for run in runs:
                    run.steps, run.purged_at = purged_steps(run.steps), now


def purged_steps(text: str | None) -> str | None:
    if text is None:
        return None
    steps = json.loads(text)
    for step in steps:
        step["args"] = None
        if step.get("compensate"):
            step["compensate"]["args"] = None
    return json.dumps(steps, ensure_ascii=False, separators=(",", ":"))
