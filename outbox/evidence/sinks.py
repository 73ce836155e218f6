"""Evidence: the auditable record that an effect happened (provider reference, digests).

The default sink is the ``evidence`` table of the ledger, written in the same transaction as the
success itself (it cannot fail on its own). ``OUTBOX_EVIDENCE_URL`` moves it to a separate
database, which can: then a success whose evidence could not be written becomes
``committed_evidence_degraded`` (never retried: the effect happened) and ``backfill`` writes the
record when the sink is back, moving the operation to ``succeeded``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, insert, literal, select
from sqlalchemy.orm import Session, sessionmaker

from outbox.evidence.health import SinkHealth
from outbox.evidence.settlement import evidence_backfilled
from outbox.ledger import failpoints
from outbox.ledger.claims import Claim
from outbox.ledger.clock import db_now
from outbox.ledger.db import connect_timeout_args, make_engine
from outbox.ledger.drivers import driver_for
from outbox.ledger.models import Evidence, Operation, core_table
from outbox.ledger.states import Status
from outbox.ledger.transitions import AttemptReport, commit_even_if_stale

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvidenceRecord:
    operation_id: str
    tenant: str
    idempotency_key: str
    action: str
    args_digest: str
    provider_reference: str | None
    response_digest: str | None
    attempt_log_digest: str


# What the attempt log digest covers, per attempt row (in id order).
_LOG_COLUMNS = (
    "id",
    "operation_id",
    "attempt_number",
    "kind",
    "fencing_token",
    "attempt_class",
    "status_code",
    "request_digest",
    "response_digest",
    "provider_reference",
)


def attempt_log_digest(session: Session, operation_id: str, *, current: tuple[int, AttemptReport] | None = None) -> str:
    """sha256 over every attempt of the operation (the current one as reported, if not yet written)."""
    return attempt_log_digests(session, [operation_id], current=dict([current]) if current else None)[operation_id]


def attempt_log_digests(
    session: Session, operation_ids: Sequence[str], *, current: dict[int, AttemptReport] | None = None
) -> dict[str, str]:
    """attempt_log_digest for several operations in one query (a doorbell batch)."""
    if not operation_ids:
        return {}
    rows = driver_for(session).attempt_log(session, operation_ids, _LOG_COLUMNS)
    logs: dict[str, list[dict[str, Any]]] = {op_id: [] for op_id in operation_ids}
    for a in rows:
        item = dict(
            n=a.attempt_number,
            kind=a.kind,
            token=a.fencing_token,
            cls=a.attempt_class,
            status=a.status_code,
            sent=a.request_digest,
            got=a.response_digest,
            ref=a.provider_reference,
        )
        if current and a.id in current:
            r = current[a.id]
            item.update(
                cls=r.klass.value,
                status=r.status_code,
                sent=r.request_digest,
                got=r.response_digest,
                ref=r.provider_reference,
            )
        logs[a.operation_id].append(item)
    return {
        op_id: hashlib.sha256(json.dumps(items, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        for op_id, items in logs.items()
    }


def records_for_claims(session: Session, finished: Sequence[tuple[Claim, AttemptReport]]) -> list[EvidenceRecord]:
    """Evidence for claims whose success was just written in ``session`` (one query for all)."""
    digests = attempt_log_digests(session, [c.operation_id for c, _ in finished])
    return [
        EvidenceRecord(
            c.operation_id,
            c.tenant,
            c.idempotency_key,
            c.action,
            c.args_digest,
            r.provider_reference,
            r.response_digest,
            digests[c.operation_id],
        )
        for c, r in finished
    ]


def record_for(
    session: Session,
    op: Operation,
    *,
    reference: str | None,
    response_digest: str | None,
    current: tuple[int, AttemptReport] | None = None,
) -> EvidenceRecord:
    return EvidenceRecord(
        op.id,
        op.tenant,
        op.idempotency_key,
        op.action,
        op.args_digest,
        reference,
        response_digest,
        attempt_log_digest(session, op.id, current=current),
    )


# A separate store that stops answering (a host gone, not a refused connection) must not hold a
# success's finalize, a backfill or a health probe for the operating system's TCP timeout (~2 min).
SINK_CONNECT_TIMEOUT_S = 5


class EvidenceSink:
    """Where evidence goes. ``separate`` sinks are written in their own transaction and may fail;
    ``health`` is what this process knows of whether they answer (outbox/evidence/health.py)."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self._table_ready = engine is None
        self.health = SinkHealth(self._probe)

    @classmethod
    def from_url(cls, url: str) -> EvidenceSink:
        if not url:
            return cls(None)
        sink = cls(make_engine(url, **connect_timeout_args(url, SINK_CONNECT_TIMEOUT_S)))
        try:
            sink._ensure_table()
        except Exception as exc:  # noqa: BLE001 - a sink that is down at start-up must not stop workers
            # Successes become committed_evidence_degraded until it is back; backfill repairs them;
            # actions that require evidence wait (health logs it once).
            sink.health.saw(False, exc)
        else:
            sink.health.saw(True)
        return sink

    def available(self) -> bool:
        """Whether evidence can be written now, as far as this process knows (no round trip unless
        what it knows is stale: health.py). The ledger's own table is always available."""
        return self.engine is None or self.health.is_up()

    def _probe(self) -> None:
        if self.engine is None:
            return
        self._ensure_table()
        with self.engine.connect() as conn:
            conn.execute(select(literal(1)))

    def _ensure_table(self) -> None:
        if not self._table_ready and self.engine is not None:
            core_table(Evidence).create(self.engine, checkfirst=True)
            self._table_ready = True

    @property
    def separate(self) -> bool:
        return self.engine is not None

    def write(self, record: EvidenceRecord, *, session: Session | None = None) -> None:
        """Append the record: in ``session`` (same-database sink) or in the sink's own transaction."""
        self.write_many([record], session=session)

    def write_many(self, records: Sequence[EvidenceRecord], *, session: Session | None = None) -> None:
        if not records:
            return
        if self.engine is None:
            if session is None:
                raise ValueError("the default evidence sink writes in the ledger transaction: pass session")
            driver_for(session).insert_evidence(session, [asdict(r) for r in records])
            return
        stmt = insert(Evidence).values([dict(asdict(r), recorded_at=db_now()) for r in records])
        try:
            self._ensure_table()
            with self.engine.begin() as conn:
                conn.execute(stmt)
        except Exception as exc:
            self.health.saw(False, exc)
            raise
        self.health.saw(True)

    def write_separately(self, record: EvidenceRecord) -> Status:
        """A separate sink's write, before the success is recorded: succeeded, or
        committed_evidence_degraded when the sink is down (the effect happened all the same)."""
        try:
            self.write(record)
        except Exception as exc:  # noqa: BLE001 - the effect happened; never lose that fact
            log.warning(
                "evidence sink unavailable; recording committed_evidence_degraded: %s",
                exc,
                extra={"operation_id": record.operation_id},
            )
            return Status.COMMITTED_EVIDENCE_DEGRADED
        return Status.SUCCEEDED

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()


def backfill(ledger: Session, sink: EvidenceSink, *, limit: int = 100, actor: str = "backfill") -> tuple[int, int]:
    """Write evidence for committed_evidence_degraded operations; returns (written, still failing).

    The rows are read locked (SKIP LOCKED: another relay's or the sweep task's backfill takes the
    others), so no two backfills write the same record and each move still finds what was read.
    """
    ops = list(
        ledger.execute(
            select(Operation)
            .where(Operation.status == Status.COMMITTED_EVIDENCE_DEGRADED.value)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    failpoints.hit("backfill.after_select_before_update")
    written = failing = 0
    for op in ops:
        record = record_for(ledger, op, reference=op.result_reference, response_digest=op.result_digest)
        try:
            sink.write(record, session=ledger)
        except Exception as exc:  # noqa: BLE001 - the sink is allowed to be down; try again later
            failing += 1
            log.warning("evidence sink still unavailable: %s", exc, extra={"operation_id": op.id})
            continue
        evidence_backfilled(ledger, op.id, actor=actor)
        written += 1
    return written, failing


def finish_with_evidence(
    sessions: sessionmaker[Session],
    sink: EvidenceSink,
    claim: Claim,
    report: AttemptReport,
    finalize: Callable[[Session, Status], None],
) -> Status:
    """Record a confirmed effect: evidence + the guarded move to succeeded (or degraded).

    ``finalize(session, to)`` performs the fenced transition. A separate sink is written first, in
    its own transaction; if it fails the effect is still recorded, as committed_evidence_degraded.
    A stale token raises StaleFence after the attempt's evidence has been committed.
    """
    to = Status.SUCCEEDED
    if sink.separate:
        with sessions() as s:
            op = s.get(Operation, claim.operation_id)
            assert op is not None
            record = record_for(
                s,
                op,
                reference=report.provider_reference,
                response_digest=report.response_digest,
                current=(claim.attempt_id, report),
            )
        to = sink.write_separately(record)

    def write(s: Session) -> None:
        finalize(s, to)
        if not sink.separate:
            op = s.get(Operation, claim.operation_id)
            assert op is not None
            sink.write(
                record_for(s, op, reference=report.provider_reference, response_digest=report.response_digest),
                session=s,
            )

    commit_even_if_stale(sessions, write)
    return to
