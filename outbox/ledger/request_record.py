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
``request_digest``), the header its key went in, and the action's version it was built under
(outbox/actions/versions.py). An operation that recorded no version at submit takes this one.

Between a send and its finalize a worker can die, freeze past its lease or lose it. A finalize
refused for a lost lease still records the request if none is yet (the drivers' ``record_request``:
what left is a fact about the provider; the first record wins). With nothing on record at all, the
attempt rows say what it was built from: every dispatch claim writes on the row it opens the version
of the action its worker holds (the one it builds under), and the next claim reads those of the
earlier attempts that may have left (``left_versions_sql``), in the claim statement itself
(workers/dispatch/same_request.py decides with them). Not the version at submit: a producer may
have no actions file, or, in a rolling deploy, a newer one than the worker that sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.ledger.models import ATTEMPTS, OPERATIONS
from outbox.ledger.states import AttemptClass, AttemptKind

# The operation's columns of the record, in RequestRecord's order (the claim reads them), and the
# finalize's parameters that carry them (not the attempt row's own request_digest).
RECORD_COLUMNS = (
    "request_version",
    "request_method",
    "request_path",
    "request_body",
    "request_digest",
    "request_key_header",
)
RECORD_PARAMS = ("sent_version", "sent_method", "sent_path", "sent_body", "sent_digest", "sent_key_header")


@dataclass(frozen=True)
class RequestRecord:
    """A request under an operation's key: the one on record (a claim's ``sent``) or the one an
    attempt sent (its report's ``sent``, recorded if none is yet)."""

    version: str | None  # the action's version it was built under; None: not known (a hook's own)
    method: str | None = None  # None: built by a Python hook connector, which keeps its own request
    path: str | None = None  # path and query as sent, relative to the target's base_url
    body: str | None = None  # canonical JSON text; None: no body, or purged
    digest: str | None = None  # sha256 of method, URL and body (the attempt row's request_digest)
    # The header that carried the idempotency key, lower case; "": none (the key went nowhere, or
    # only where the path or body template put it); None: not known (recorded before migration 0021,
    # or a hook's own request).
    key_header: str | None = None

    @classmethod
    def of_row(cls, row: Any) -> RequestRecord | None:
        """The record of a claimed row (ClaimedRow), None when nothing is on record."""
        version, method, path, body, digest, key_header = (getattr(row, name, None) for name in RECORD_COLUMNS)
        if version is None and method is None and digest is None:
            return None
        return cls(version, method, path, body, digest, key_header)

    def params(self) -> dict[str, Any]:
        """As the finalize's parameters (FinalizeWrite.params, RECORD_PARAMS)."""
        values = (self.version, self.method, self.path, self.body, self.digest, self.key_header)
        return dict(zip(RECORD_PARAMS, values))


NO_RECORD: dict[str, Any] = dict.fromkeys(RECORD_PARAMS)
# The operation's record columns emptied (a person found nothing under the key: settlement.resolve_by_person).
CLEARED: dict[str, Any] = dict.fromkeys(RECORD_COLUMNS)


# Unknown: an earlier attempt whose version is not known (claimed before migration 0021, with none
# recorded at submit either). In left_versions_sql's list as the empty string.
UNKNOWN = None


def left_versions_sql(op: str, distinct_list: str) -> str:
    """SQL, for the operation row ``op`` being claimed for a dispatch: when nothing is on record,
    the versions of the action its earlier dispatch attempts were claimed under, of those that may
    have reached the provider: any class but not_sent (it left, or its worker never reported),
    numbered after ``proven_absent_through`` (a fenced lookup, the provider's record or a person
    proved none before can land), as a comma-separated list ("" for an unknown one: an attempt
    claimed before migration 0021 counts as built under the version at submit, if any). NULL when
    a request is on record or none may have left. Evaluated in the claim's own statement (by the
    attempts' (operation_id, kind, number) index), and only where ``attempt_count`` (the claim's,
    this attempt counted) is over 1: a count of 1 means every earlier dispatch attempt was refunded,
    and only an attempt that sent nothing is (a wait for a breaker, a limit, an object, the evidence
    store, an approval), so a first attempt, the hot path's, reads nothing more.
    ``distinct_list``: the driver's aggregate of distinct values joined by commas, ``{}`` for the
    value (PostgreSQL ``string_agg(DISTINCT {}, ',')``, SQLite ``group_concat(DISTINCT {})``)."""
    agg = distinct_list.format(f"coalesce(a.action_version, {op}.action_version, '')")
    return (
        f"CASE WHEN {op}.request_version IS NULL AND {op}.attempt_count > 1 THEN (SELECT {agg} FROM {ATTEMPTS} a"
        f" WHERE a.operation_id = {op}.id AND a.kind = '{AttemptKind.DISPATCH.value}'"
        f" AND a.attempt_class <> '{AttemptClass.NOT_SENT.value}' AND a.attempt_number > {op}.proven_absent_through)"
        " END"
    )


def left_versions(text: str | None) -> frozenset[str | None]:
    """``left_versions_sql``'s answer as a set (None for an unknown version)."""
    if text is None:
        return frozenset()
    return frozenset(v or UNKNOWN for v in text.split(","))


def _late(column: str, param: str) -> str:
    # Path and body only while the arguments they were built from are kept (retention purges them
    # together): a request recorded late, after a purge, records neither.
    value = f"CAST(:{param} AS text)"
    return f"CASE WHEN args IS NULL THEN NULL ELSE {value} END" if column in ("request_path", "request_body") else value


# A refused finalize's request (its lease lost), recorded if none is: the drivers' record_request,
# one spelling for both (``:name`` parameters: RECORD_PARAMS and :operation_id).
RECORD_IF_NONE = f"""
UPDATE {OPERATIONS} SET {", ".join(f"{c} = {_late(c, p)}" for c, p in zip(RECORD_COLUMNS, RECORD_PARAMS))},
    action_version = coalesce(action_version, CAST(:sent_version AS text))
WHERE id = :operation_id AND request_version IS NULL
RETURNING id"""
