"""The request on record under an operation's key: what its first attempt that left sent.

A provider that honours idempotency keys keeps, for a key, the first request it saw: Stripe answers
a later request under the key with other parameters with an error; a provider that does not compare
does whatever the later request says. So every attempt under a key must send what the first one
sent, whatever was deployed since (an actions file with another path, ``query:`` or ``decimal_args``).

The record is written by the finalize of the first attempt that may have left (any class but
not_sent), in the UPDATE that finalize makes anyway (outbox/ledger/writes.py ``RECORD_FIRST``), never
overwritten: its method, path with query (relative to the target's ``base_url``, as encoded on the
wire), body (canonical JSON; kept only while another attempt can follow, purged with the arguments:
outbox/privacy/retention.py), the digest of the whole request (method, URL, body: the attempt rows'
``request_digest``) and the action's version it was built under (outbox/actions/versions.py). An
operation that recorded no version at submit takes this one.

Between a send and its finalize a worker can die: then nothing is on record, and only the version
recorded at submit says what the request was built from (workers/dispatch/same_request.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from outbox.ledger.models import Attempt
from outbox.ledger.states import AttemptClass, AttemptKind

# The operation's columns of the record, in RequestRecord's order (the claim reads them), and the
# finalize's parameters that carry them (not the attempt row's own request_digest).
RECORD_COLUMNS = ("request_version", "request_method", "request_path", "request_body", "request_digest")
RECORD_PARAMS = ("sent_version", "sent_method", "sent_path", "sent_body", "sent_digest")


@dataclass(frozen=True)
class RequestRecord:
    """A request under an operation's key: the one on record (a claim's ``sent``) or the one an
    attempt sent (its report's ``sent``, recorded if none is yet)."""

    version: str | None  # the action's version it was built under; None: not known (a hook's own)
    method: str | None = None  # None: built by a Python hook connector, which keeps its own request
    path: str | None = None  # path and query as sent, relative to the target's base_url
    body: str | None = None  # canonical JSON text; None: no body, or purged
    digest: str | None = None  # sha256 of method, URL and body (the attempt row's request_digest)

    @classmethod
    def of_row(cls, row: Any) -> RequestRecord | None:
        """The record of a claimed row (ClaimedRow), None when nothing is on record."""
        version, method, path, body, digest = (getattr(row, name, None) for name in RECORD_COLUMNS)
        if version is None and method is None and digest is None:
            return None
        return cls(version, method, path, body, digest)

    def params(self) -> dict[str, Any]:
        """As the finalize's parameters (FinalizeWrite.params, RECORD_PARAMS)."""
        return dict(zip(RECORD_PARAMS, (self.version, self.method, self.path, self.body, self.digest)))


NO_RECORD: dict[str, Any] = dict.fromkeys(RECORD_PARAMS)
# The operation's record columns emptied (a person found nothing under the key: settlement.resolve_by_person).
CLEARED: dict[str, Any] = dict.fromkeys(RECORD_COLUMNS)


def left_before(session: Any, attempts: Sequence[tuple[str, int, int]]) -> set[str]:
    """Of these (operation id, its current dispatch attempt's number, its proven_absent_through), the
    operations with an earlier dispatch attempt that may have reached the provider: any class but
    not_sent (it left, or its worker never reported), not proven unable to take effect (a fenced
    lookup, a person's "not executed": then the provider holds nothing under the key). One read,
    made only for claims whose request is in question (workers/dispatch/same_request.py)."""
    if not attempts:
        return set()
    window = {op_id: (absent, current) for op_id, current, absent in attempts}
    rows = session.execute(
        select(Attempt.operation_id, Attempt.attempt_number).where(
            Attempt.operation_id.in_(list(window)),
            Attempt.kind == AttemptKind.DISPATCH.value,
            Attempt.attempt_class != AttemptClass.NOT_SENT.value,
        )
    ).all()
    return {op_id for op_id, number in rows if window[op_id][0] < number < window[op_id][1]}
