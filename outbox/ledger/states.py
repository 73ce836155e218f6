"""The operation state machine: every state, what it means, and the allowed transitions.

This module is the one place that says which status may follow which. The database holds the
same set of states in a CHECK constraint (see ``models.py``). ``transitions.move`` and the
finalize check ``ALLOWED`` before every write; the moves written as single statements (claims,
breaker park/wake) are checked against it when their module loads; and the test suite checks that
every move its operations took is listed (tests/conftest.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from outbox.errors import IllegalTransition


class Status(str, enum.Enum):
    """The states of an operation (DESIGN.md, "Operation states")."""

    AWAITING_APPROVAL = "awaiting_approval"
    NOT_DISPATCHED = "not_dispatched"
    DISPATCHING = "dispatching"
    SUCCEEDED = "succeeded"
    COMMITTED_EVIDENCE_DEGRADED = "committed_evidence_degraded"
    FAILED_BEFORE_COMMIT = "failed_before_commit"
    OUTCOME_UNKNOWN = "outcome_unknown"
    RECONCILIATION_REQUIRED = "reconciliation_required"
    CANCELLED = "cancelled"
    ACCEPTED = "accepted"
    FAILED_AT_PROVIDER = "failed_at_provider"
    ABANDONED = "abandoned"

    def __str__(self) -> str:
        return self.value


MEANING: dict[Status, str] = {
    Status.AWAITING_APPROVAL: "waiting for a person to approve the intent; nothing has been sent",
    Status.NOT_DISPATCHED: "accepted and due at next_attempt_at; no request in flight",
    Status.DISPATCHING: "a worker holds the lease and may be calling the downstream right now",
    Status.SUCCEEDED: "the downstream confirmed the effect; evidence recorded",
    Status.COMMITTED_EVIDENCE_DEGRADED: (
        "the effect happened but its evidence record is being repaired; never retried"
    ),
    Status.FAILED_BEFORE_COMMIT: (
        "ended with proof that no effect happened: no attempt can still take effect and none is confirmed"
    ),
    Status.OUTCOME_UNKNOWN: (
        "a request may have reached the downstream and we lost the answer; "
        "the reconciler asks the provider, nothing is re-sent without proof"
    ),
    Status.RECONCILIATION_REQUIRED: "automation could not settle it; a handoff waits for a person",
    Status.CANCELLED: "cancelled before anything that could still take effect was sent",
    Status.ACCEPTED: (
        "the provider took the request (a 202, or a status the action calls pending) and has not finished it; "
        "the reconciler looks it up until the provider says done or failed; nothing is re-sent"
    ),
    Status.FAILED_AT_PROVIDER: (
        "the provider took the request and then reported it failed (a status in the action's lookup.failed): "
        "no effect remains, but the provider holds a record of it, so it is not failed_before_commit"
    ),
    Status.ABANDONED: (
        "a person closed its handoff without knowing whether it took effect (abandoned, or retried as a new "
        "intent): nothing more is sent or looked up under its key; a confirmation from the provider still settles it"
    ),
}

# Abandoned is an end (nothing more is sent or looked up) that claims neither an effect nor its
# absence: a person stopped looking. It is in AWAITING_OUTCOME too, so evidence still settles it.
TERMINAL: frozenset[Status] = frozenset(
    {Status.SUCCEEDED, Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER, Status.CANCELLED, Status.ABANDONED}
)

# States that say "the effect happened" (evidence recorded, or being repaired).
EFFECT: frozenset[Status] = frozenset({Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED})

# Terminal states that say "no effect happened". The ledger enters them only while no attempt can
# still take effect and none is confirmed (effect_guard.py). A provider-confirmed
# success that arrives anyway contradicts them: a person reviews (outbox/evidence/late_successes.py).
# failed_at_provider is one of them: the provider's own record of the key says it failed, which
# proves that no attempt of this key can still take effect there.
NO_EFFECT: frozenset[Status] = frozenset({Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER, Status.CANCELLED})

# States that claim no outcome yet. A late success (an attempt whose worker lost its lease and
# still got the provider's 2xx) settles them: evidence wins (DESIGN.md).
AWAITING_OUTCOME: frozenset[Status] = frozenset(
    {
        Status.AWAITING_APPROVAL,
        Status.NOT_DISPATCHED,
        Status.DISPATCHING,
        Status.OUTCOME_UNKNOWN,
        Status.ACCEPTED,
        Status.RECONCILIATION_REQUIRED,
        Status.ABANDONED,
    }
)

# States a worker may claim from. outcome_unknown and accepted rows are claimed by the reconciler,
# which looks the effect up instead of sending the request again. A claim keeps the status.
DISPATCH_CLAIMABLE: frozenset[Status] = frozenset({Status.NOT_DISPATCHED})
RECONCILE_CLAIMABLE: frozenset[Status] = frozenset({Status.OUTCOME_UNKNOWN, Status.ACCEPTED})

# (from, to) -> the event that causes it. Anything not listed is refused.
ALLOWED: dict[tuple[Status, Status], str] = {
    (Status.AWAITING_APPROVAL, Status.NOT_DISPATCHED): "approve",
    (Status.AWAITING_APPROVAL, Status.CANCELLED): "cancel",
    (Status.AWAITING_APPROVAL, Status.SUCCEEDED): "an earlier attempt's success arrived late",
    (
        Status.AWAITING_APPROVAL,
        Status.COMMITTED_EVIDENCE_DEGRADED,
    ): "an earlier attempt's success arrived late, evidence store down",
    (Status.NOT_DISPATCHED, Status.DISPATCHING): "claim",
    (Status.NOT_DISPATCHED, Status.CANCELLED): "cancel (nothing sent can still take effect)",
    (Status.NOT_DISPATCHED, Status.AWAITING_APPROVAL): "approval expired",
    # Waits that send nothing and claim nothing: a breaker open parks it until its reopen time, a
    # breaker reset wakes it at once (waiting_for says which wait it is in).
    (Status.NOT_DISPATCHED, Status.NOT_DISPATCHED): "breaker open: parked until it may close / breaker reset: woken"
    " / its subject stopped: held, resumed: woken / its submitting key revoked: parked until every worker knows",
    (Status.NOT_DISPATCHED, Status.SUCCEEDED): "an earlier attempt's success arrived late",
    (
        Status.NOT_DISPATCHED,
        Status.COMMITTED_EVIDENCE_DEGRADED,
    ): "an earlier attempt's success arrived late, evidence store down",
    (
        Status.DISPATCHING,
        Status.SUCCEEDED,
    ): "2xx with a provider reference (this attempt's, or an earlier one's arriving late)",
    (
        Status.DISPATCHING,
        Status.CANCELLED,
    ): "cancel requested, or its submitting key revoked with --cancel-queued, seen by the worker before sending",
    (Status.DISPATCHING, Status.COMMITTED_EVIDENCE_DEGRADED): "2xx, evidence store down",
    (
        Status.DISPATCHING,
        Status.FAILED_BEFORE_COMMIT,
    ): "rejected, or budget spent, while no attempt can still take effect",
    (Status.DISPATCHING, Status.NOT_DISPATCHED): "retry scheduled (provably not executed, budget left)",
    (
        Status.DISPATCHING,
        Status.AWAITING_APPROVAL,
    ): "approval expired or its policy changed before the send: nothing sent",
    (
        Status.DISPATCHING,
        Status.OUTCOME_UNKNOWN,
    ): "ambiguous result, lease expired, or an earlier attempt may still land",
    (
        Status.DISPATCHING,
        Status.ACCEPTED,
    ): "2xx that says accepted, not finished (a 202, or a status in lookup.pending)",
    (Status.DISPATCHING, Status.FAILED_AT_PROVIDER): "2xx whose status says it failed at the provider (lookup.failed)",
    # Nothing was executed, and automation must not decide the rest: the provider refused our
    # authority (a target's authority_statuses), the action says on_final_failure: handoff, or the
    # request its key names cannot be sent again (workers/dispatch/same_request.py).
    (
        Status.DISPATCHING,
        Status.RECONCILIATION_REQUIRED,
    ): "the provider refused our credentials, a final failure the action hands to a person, a request its key"
    " names that cannot be sent again, or its submitting key was revoked (nothing sent): handoff",
    (Status.COMMITTED_EVIDENCE_DEGRADED, Status.SUCCEEDED): "evidence backfilled",
    # Accepted: the provider has it; only its lookups (or a late answer) settle it. Nothing is sent.
    (Status.ACCEPTED, Status.ACCEPTED): "reconciler claim / still pending at the provider: re-check later",
    (Status.ACCEPTED, Status.SUCCEEDED): "lookup found it done, or an attempt's success arrived late",
    (Status.ACCEPTED, Status.COMMITTED_EVIDENCE_DEGRADED): "lookup found it done, evidence store down",
    (Status.ACCEPTED, Status.FAILED_AT_PROVIDER): "lookup found it failed at the provider",
    (Status.ACCEPTED, Status.RECONCILIATION_REQUIRED): "still not finished within the reconciler's budget: handoff",
    (Status.OUTCOME_UNKNOWN, Status.ACCEPTED): "lookup found it accepted, not finished (a status in lookup.pending)",
    (Status.OUTCOME_UNKNOWN, Status.FAILED_AT_PROVIDER): "lookup found it failed at the provider",
    (
        Status.FAILED_AT_PROVIDER,
        Status.RECONCILIATION_REQUIRED,
    ): "late success evidence contradicts it: a person reviews",
    (Status.OUTCOME_UNKNOWN, Status.OUTCOME_UNKNOWN): "reconciler claim / re-check later",
    (Status.OUTCOME_UNKNOWN, Status.SUCCEEDED): "lookup found the effect, or an attempt's success arrived late",
    (Status.OUTCOME_UNKNOWN, Status.FAILED_BEFORE_COMMIT): "lookup found nothing where no attempt can still land",
    (Status.OUTCOME_UNKNOWN, Status.CANCELLED): "cancel requested; lookup found nothing and no attempt can still land",
    (Status.OUTCOME_UNKNOWN, Status.NOT_DISPATCHED): "lookup found nothing: re-dispatch with the same key",
    (Status.OUTCOME_UNKNOWN, Status.RECONCILIATION_REQUIRED): "cannot settle within budget: handoff",
    (Status.OUTCOME_UNKNOWN, Status.COMMITTED_EVIDENCE_DEGRADED): "lookup found the effect, evidence store down",
    (
        Status.RECONCILIATION_REQUIRED,
        Status.SUCCEEDED,
    ): "person resolved: succeeded, or an attempt's success arrived late",
    (Status.RECONCILIATION_REQUIRED, Status.COMMITTED_EVIDENCE_DEGRADED): (
        "an attempt's success arrived late, evidence store down"
    ),
    (Status.RECONCILIATION_REQUIRED, Status.NOT_DISPATCHED): "person resolved: not executed",
    # A handoff is a case that keeps working (outbox/evidence/rechecks.py): its lookups go on while a
    # person owns it, and what the provider says settles it; taking or releasing it moves nothing.
    (Status.RECONCILIATION_REQUIRED, Status.RECONCILIATION_REQUIRED): (
        "handoff re-check claimed, or found nothing yet (looked up again later); the handoff taken or released"
    ),
    (Status.RECONCILIATION_REQUIRED, Status.FAILED_AT_PROVIDER): "a handoff's re-check found it failed at the provider",
    # Abandoned: a person closed the case without proof either way (or retried it as a new intent):
    # an end that claims nothing, which the provider's confirmation still settles.
    (Status.RECONCILIATION_REQUIRED, Status.ABANDONED): "person resolved: abandoned, or retried as a new intent",
    (Status.ABANDONED, Status.ABANDONED): "person retried an abandoned operation as a new intent",
    (Status.ABANDONED, Status.SUCCEEDED): "an attempt's success arrived late, after a person abandoned it",
    (Status.ABANDONED, Status.COMMITTED_EVIDENCE_DEGRADED): (
        "an attempt's success arrived late, after a person abandoned it, evidence store down"
    ),
    # The only ways out of a terminal state: it said "no effect" and the provider confirmed one
    # (a provider that does not fence though declared to, or a person's wrong "not executed").
    # The agent was told it did not happen, so a person reviews; it is never left as it was.
    (
        Status.FAILED_BEFORE_COMMIT,
        Status.RECONCILIATION_REQUIRED,
    ): "late success evidence contradicts it: a person reviews",
    (Status.CANCELLED, Status.RECONCILIATION_REQUIRED): "late success evidence contradicts it: a person reviews",
}


def is_allowed(current: Status, new: Status) -> bool:
    return (current, new) in ALLOWED


def check_allowed(operation_id: str, sources: Iterable[Status], to: Status) -> None:
    """Raise IllegalTransition unless every ``source -> to`` is in ALLOWED (``operation_id`` "*":
    a module checking, when it loads, the moves its single statements make)."""
    for src in sources:
        if (src, to) not in ALLOWED:
            raise IllegalTransition(operation_id, src.value, to.value)


def sources_of(new: Status) -> frozenset[Status]:
    """Every status from which ``new`` may be reached."""
    return frozenset(src for (src, dst) in ALLOWED if dst == new)


class AttemptClass(str, enum.Enum):
    """What one transport attempt proved (DESIGN.md, "Failure classification")."""

    NOT_SENT = "not_sent"  # failed before the request left: connect refused, breaker open
    NOT_PROCESSED = "not_processed"  # 429 / 503: not processed by definition
    REJECTED = "rejected"  # business rejection (4xx): provably no effect
    AMBIGUOUS = "ambiguous"  # may have happened: timeout after send, reset, 500/502/504, bad 2xx
    SUCCEEDED = "succeeded"  # 2xx with a provider reference
    ACCEPTED = "accepted"  # 2xx that says taken, not finished: a 202, or a status in lookup.pending
    PENDING = "pending"  # attempt row open: the worker has not reported back (yet)

    def __str__(self) -> str:
        return self.value


# Classes that prove the downstream did NOT apply the effect.
PROVABLY_NOT_EXECUTED: frozenset[AttemptClass] = frozenset(
    {AttemptClass.NOT_SENT, AttemptClass.NOT_PROCESSED, AttemptClass.REJECTED}
)


class AttemptKind(str, enum.Enum):
    """What an attempt row records: a request sent to the provider, or a question asked of it."""

    DISPATCH = "dispatch"  # a worker sends the request (with the idempotency key)
    LOOKUP = "lookup"  # the reconciler asks the provider what became of the key

    def __str__(self) -> str:
        return self.value


class WaitingFor(str, enum.Enum):
    """Why a not_dispatched or outcome_unknown operation is not due yet (``operations.waiting_for``);
    on a reconciliation_required one that nothing executed, what the person is asked for.

    NULL: due at ``next_attempt_at`` for no reason but its schedule (a fresh intent). The reason
    text next to it is for people; code decides on this column.
    """

    BREAKER = "breaker"  # its downstream's breaker is open: woken when it may close, or on reset
    BACKOFF = "backoff"  # a retry on our own backoff: after a failure that proved nothing, or a safe replay
    RETRY_AFTER = "retry_after"  # the provider said when to come back (Retry-After)
    APPROVAL = "approval"  # a person must approve first
    LOOKUP = "lookup"  # the reconciler will ask the provider what became of it
    PROVIDER = "provider"  # accepted: the provider is still processing it; the reconciler asks again
    RATE_LIMIT = "rate_limit"  # a limit its target declares (rate or concurrency) had no room: not sent yet
    OBJECT = "object"  # another operation on the same business object may have taken effect unseen
    EVIDENCE = "evidence"  # its action requires evidence and the evidence store is down: not sent yet
    # reconciliation_required, nothing executed: what the person is asked for.
    CREDENTIALS = "credentials"  # the provider refused our authority (401/403): check or rotate them
    DECISION = "decision"  # a final failure the action hands to a person (on_final_failure: handoff)
    REQUEST = "request"  # the request its key names cannot be sent again as it was (a changed definition)
    # Authority re-checked when work continues (outbox/ledger/authority.py): nothing leaves in its name.
    STOPPED = "stopped"  # not_dispatched: an operator stopped its subject; held until they resume it
    AUTHORITY = "authority"  # the key that submitted it was revoked: a person decides (parked until then)

    def __str__(self) -> str:
        return self.value


WAITING_MEANING: dict[WaitingFor, str] = {
    WaitingFor.BREAKER: "its downstream's breaker is open; due when it may close, or at once on `breakers reset`",
    WaitingFor.BACKOFF: (
        "a retry at next_attempt_at on our backoff (with jitter): the last attempt provably did nothing,"
        " or replaying it with the same key is safe"
    ),
    WaitingFor.RETRY_AFTER: "a retry at the time the provider asked for (Retry-After)",
    WaitingFor.APPROVAL: "a person must approve it first",
    WaitingFor.LOOKUP: "the reconciler will ask the provider what became of it, at next_attempt_at",
    WaitingFor.PROVIDER: "the provider accepted it and is still processing it; the reconciler asks again at next_attempt_at",
    WaitingFor.RATE_LIMIT: (
        "its target's declared rate or concurrency limit had no room: not sent, the attempt not counted;"
        " tried again at next_attempt_at"
    ),
    WaitingFor.OBJECT: (
        "another operation on the same business object (the action's `object`) is in flight, outcome unknown,"
        " with a person or awaiting approval: not sent, the attempt not counted; looked at again at next_attempt_at"
        " (the reason names the blocking operation)"
    ),
    WaitingFor.EVIDENCE: (
        "its action requires evidence (evidence.required, or OUTBOX_EVIDENCE_REQUIRED) and the separate evidence"
        " store (OUTBOX_EVIDENCE_URL) is down: not sent, the attempt not counted; sent once the store is back"
    ),
    WaitingFor.CREDENTIALS: (
        "the provider refused our credentials (a status in the target's authority_statuses); nothing was"
        " executed: a person checks or rotates them, then resolves it (not-executed sends it again, same key)"
    ),
    WaitingFor.DECISION: (
        "it would have ended failed_before_commit (the reason says why); nothing was executed, and the action"
        " asks a person instead (on_final_failure: handoff): resolve not-executed to send it again, or abandon it"
    ),
    WaitingFor.REQUEST: (
        "the request first sent under its key cannot be sent again as it was, nor built again under the same"
        " definition (the reason names the action's versions); nothing was sent: a person looks for the key at the"
        " provider, then resolves it (not-executed builds it from the current definition)"
    ),
    WaitingFor.STOPPED: (
        "an operator stopped its subject (agent-outbox subjects stop; the reason says who, when and why): held, not"
        " sent, the attempt not counted; due at once when they resume it (agent-outbox subjects resume)"
    ),
    WaitingFor.AUTHORITY: (
        "the API key that submitted it was revoked (the reason says when): nothing more is sent in its name. Parked"
        " in not_dispatched a few seconds, until every worker knows, then with a person (reconciliation_required):"
        " resolve not-executed to send it in the person's name, or abandon it"
    ),
}


class EventKind(str, enum.Enum):
    """What an event of the history records (``outbox_history``: event rows, the claims and
    results recorded on attempts, the submits on operations). Its reason says it in words, for people."""

    SUBMIT = "submit"
    CLAIM = "claim"
    RECONCILE_CLAIM = "reconcile claim"
    ATTEMPT_RESULT = "attempt result"  # a worker's finalize: its attempt's class decided the move
    LOOKUP_RESULT = "lookup result"  # the reconciler's settlement: what the lookup proved
    LEASE_EXPIRED = "lease expired"
    BREAKER_OPEN = "breaker open"  # parked without a claim until the breaker may close
    BREAKER_RESET = "breaker reset"  # an operator reset the breaker: parked operations woken
    CANCEL = "cancel"
    # A cancel asked for while it could not take effect yet (in flight, or an earlier attempt may
    # still land): who, when and why, with the status unchanged; the flag does the rest.
    CANCEL_REQUESTED = "cancel requested"
    APPROVE = "approve"
    DENY = "deny"  # a person denied the approval: cancelled, nothing sent
    RESOLVED_SUCCEEDED = "resolved: succeeded"
    RESOLVED_NOT_EXECUTED = "resolved: not executed"
    RESOLVED_ABANDONED = "resolved: abandoned"
    RESOLVED_RETRY = "resolved: retried as a new intent"  # the old operation's end; its new one is linked
    RESOLVED_BY_EVIDENCE = "resolved by the provider's evidence"  # a handoff's re-check found the answer
    RECHECK = "re-check"  # a handoff's lookup found nothing that settles it: looked up again later
    HANDOFF_TAKEN = "handoff taken"  # a person took the case (its owner); nothing moves
    HANDOFF_RELEASED = "handoff released"  # its owner gave it back; nothing moves
    EVIDENCE_BACKFILLED = "evidence backfilled"
    LATE_EVIDENCE = "late evidence"  # a stale attempt's confirmed success settled the operation
    LATE_EVIDENCE_CONTRADICTS = "late evidence contradicts"  # ... contradicting a "no effect" end
    WEBHOOK = "webhook"  # the provider's verified webhook event settled it, as a lookup's answer would
    SUBJECT_STOPPED = "subject stopped"  # an operator's emergency stop of its subject: held, nothing sent
    SUBJECT_RESUMED = "subject resumed"  # the stop lifted: due at once
    KEY_REVOKED = "key revoked"  # the key that submitted it was revoked: cancelled, or parked for a person

    def __str__(self) -> str:
        return self.value


class HandoffStatus(str, enum.Enum):
    """A handoff is open until a person, or the provider's late confirmation, resolves it. The
    database's CHECK on ``handoffs.status`` lists the same words (tests/unit/test_states.py)."""

    OPEN = "open"
    RESOLVED = "resolved"


class Resolution(str, enum.Enum):
    """What a person found when they resolved a handoff (or the provider's evidence said: a re-check,
    a late success, a webhook); it decides the operation's next state."""

    SUCCEEDED = "succeeded"  # the effect is there (with the provider's reference): succeeded
    NOT_EXECUTED = "not-executed"  # proven absent at the provider: sent again under the same key
    ABANDONED = "abandoned"  # nobody can tell, and nobody looks any more: abandoned, closed by a person
    # The old one ends abandoned; a new operation with a derived key does the work (outbox/evidence/retries.py).
    RETRY_AS_NEW_INTENT = "retry-as-new-intent"
    FAILED_AT_PROVIDER = "failed-at-provider"  # the provider's evidence only: it holds the key as failed


# What a person may resolve a handoff as (the last of Resolution is the provider's word only).
PERSON_RESOLUTIONS: tuple[Resolution, ...] = tuple(r for r in Resolution if r is not Resolution.FAILED_AT_PROVIDER)
