"""A worker's client CPU to finalize a doorbell and write its evidence, per operation, in-process.

Throwaway database; 60 doorbells of ``--batch`` operations each are submitted, claimed, finalized
(``finalize_many_if_fenced``, all succeeded) and their evidence written (``records_for_claims``, with
its attempt-log read, + the ledger's evidence sink), each step timed with ``time.process_time`` in
this process only: PostgreSQL's side is bench.pg_statements'. Prints the median over the last 50.

    .venv/bin/python -m bench.finalize_client [--batch 10]

Compare two commits by running it from a ``git worktree`` of each with ``PYTHONPATH`` pointing there.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from bench.scratch_database import ScratchDatabase
from outbox.evidence.sinks import EvidenceSink, records_for_claims
from outbox.ledger.claims import claim_due
from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.hot_path import LedgerConnection
from outbox.ledger.states import AttemptClass, Status
from outbox.ledger.transitions import AttemptReport, Finalize, finalize_many_if_fenced
from producer import submit

OK = AttemptReport(
    AttemptClass.SUCCEEDED,
    status_code=200,
    provider_reference="re_1",
    response_digest="d" * 64,
    request_digest="r" * 64,
    latency_s=0.01,
)
DOORBELLS, WARMUP = 60, 10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=10, help="operations per doorbell")
    args = p.parse_args(argv)
    with ScratchDatabase() as db:
        engine = make_engine(db.url)
        sessions = make_sessionmaker(engine)
        link = LedgerConnection(engine)
        sink = EvidenceSink()
        us: dict[str, list[float]] = {"finalize": [], "evidence": []}
        try:
            for n in range(DOORBELLS):
                with sessions.begin() as s:
                    for i in range(args.batch):
                        submit(
                            s,
                            tenant="t",
                            idempotency_key=uuid.uuid4().hex,
                            action="payments.refund.create",
                            args={"n": i},
                            subject="bench",
                        )
                with link.transaction() as conn:
                    claims = claim_due(conn, worker="w", lease_s=30, limit=args.batch)
                with link.transaction() as conn:
                    t0 = time.process_time()
                    items = [Finalize(c, OK, Status.SUCCEEDED, "ok", result={"id": "re_1"}) for c in claims]
                    finalize_many_if_fenced(conn, items)
                    t1 = time.process_time()
                    sink.write_many(records_for_claims(conn, [(c, OK) for c in claims]), session=conn)
                    t2 = time.process_time()
                if n >= WARMUP:
                    us["finalize"].append((t1 - t0) / len(claims) * 1e6)
                    us["evidence"].append((t2 - t1) / len(claims) * 1e6)
        finally:
            link.close()
            engine.dispose()
    print(
        f"client CPU per operation (median of {DOORBELLS - WARMUP} doorbells of {args.batch}): "
        f"finalize {statistics.median(us['finalize']):.1f} us, "
        f"evidence with its attempt-log read {statistics.median(us['evidence']):.1f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
