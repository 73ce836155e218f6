"""Each call as a task in Flower: what a dispatch attempt and a lookup say as Celery task events.

A doorbell task (outbox.dispatch, outbox.reconcile) only claims and hands its calls to the call
threads; it sends no events of its own (workers/wiring/tasks.py). The calls do, through Celery's
event protocol (event_sender.py), so Flower, ``celery events`` and any event consumer show them
as tasks, with no change on their side:

- **one task per operation**, its uuid the operation id (an operator pastes it into Flower), its
  name ``outbox.<action>``, its args the operation id and the tenant, never the intent's
  arguments. Per operation, not per attempt: Celery's own retries keep their task's uuid, and
  Flower shows such a task once, in its latest state, with ``retries`` counting the attempts before
  it. So Flower's list has one row per operation in the state the ledger has it in, and each
  operation sends exactly one succeeded or failed event, whichever process settles it: the
  dashboard's succeeded and failed counts, summed over workers, are the ledger's.
- each attempt: ``task-received`` when claimed (``retries``: the attempts before it),
  ``task-started`` when the request leaves, then the truth (``runtime``: the provider's latency):

  =========================  ============================================================
  ledger moves it to          event (Flower's state)
  =========================  ============================================================
  succeeded                   task-succeeded (SUCCESS), result: the provider's reference
  failed_before_commit,       task-failed (FAILURE): final failures only
  failed_at_provider
  not_dispatched (a retry)    task-retried (RETRY): the attempt's class and the delay
  awaiting_approval           task-retried (RETRY): sent again once approved
  outcome_unknown             task-outcome_unknown (OUTCOME_UNKNOWN): may have executed,
                              looked up, never re-sent blindly; never FAILURE
  accepted                    task-accepted (ACCEPTED): the provider has not finished it
  reconciliation_required     task-reconciliation_required: a person decides (the console)
  cancelled                   task-revoked (REVOKED)
  =========================  ============================================================

  The three custom states are the ledger's own words, upper-cased (Celery's state for a custom
  ``task-<x>`` event); Flower shows them as they are and finds them with ``state:OUTCOME_UNKNOWN``.
- **lookups the same way**, under ``outbox.lookup.<action>``: one task per operation and round of
  lookups (a uuid derived from the operation id and its dispatch attempts so far), received when
  claimed, started when the lookup leaves, retried while it looks again later, and ``SETTLED``
  (or RECONCILIATION_REQUIRED) once it moved the operation: the operation's own task carries the
  final state, so a lookup never counts as a second success.

Text in an event (a reason) has every argument value of the intent taken out (outbox/privacy's
Redactor over all of them), as arguments never travel in events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from outbox.ledger.claims import Claim
from outbox.ledger.states import AttemptClass, Status
from outbox.privacy.masking import Redactor
from workers.engine.outcomes import AttemptOutcome, RetryAt, Succeeded
from workers.ground import event_sender
from workers.provider.lookups import LookupResult

PREFIX = "outbox."
LOOKUP_PREFIX = "outbox.lookup."
# Lookup task uuids: uuid5 in this namespace (fixed: the same operation gives the same uuid everywhere).
NAMESPACE = uuid.UUID("6f1c1a3e-54a4-4b6e-9a0c-4f1d5e7a2b90")
MAX_TEXT = 300  # characters of a reason in an event: Flower's list shows a line, the console the rest

# Statuses shown as a custom state of the operation's task (the ledger's word, upper-cased by Celery).
_CUSTOM = frozenset({Status.OUTCOME_UNKNOWN, Status.ACCEPTED, Status.RECONCILIATION_REQUIRED})


def call_name(action: str) -> str:
    return PREFIX + action


def lookup_name(action: str) -> str:
    return LOOKUP_PREFIX + action


def call_uuid(operation_id: str) -> str:
    """The operation's task: the operation id itself (a uuid4, made at submit), so an operator
    pastes either into the other's search. Not parsed: three events per call ask for it."""
    return operation_id


def lookup_uuid(operation_id: str, round_: int) -> str:
    """The lookups of one round: after the operation's ``round_``-th dispatch attempt."""
    return str(uuid.uuid5(NAMESPACE, f"lookup:{operation_id}:{round_}"))


class Verdict(Protocol):
    """What a lookup concluded, as its events tell it (workers/reconcile/judge.py's LookupVerdict)."""

    @property
    def klass(self) -> AttemptClass: ...
    @property
    def reason(self) -> str: ...
    @property
    def reference(self) -> str | None: ...
    @property
    def recheck_in_s(self) -> float: ...


class Settled(Protocol):
    """A looked-up operation and its verdict (workers/reconcile/verdicts.py's Looked)."""

    @property
    def claim(self) -> Claim: ...
    @property
    def found(self) -> LookupResult | None: ...
    @property
    def verdict(self) -> Verdict: ...


# -- dispatch -----------------------------------------------------------------------------------
def claimed(claims: Sequence[Claim]) -> None:
    """A doorbell claimed these operations: one attempt each is received."""
    if not event_sender.on():
        return
    for claim in claims:
        _received(call_uuid(claim.operation_id), call_name(claim.action), claim)


def sending(claim: Claim) -> None:
    """The request leaves now."""
    if event_sender.on():
        event_sender.send("task-started", {"uuid": call_uuid(claim.operation_id), "timestamp": time.time()})


def dispatched(applied: Iterable[tuple[Claim, AttemptOutcome, Status, str, Mapping[str, Any]]]) -> None:
    """Finalized (after the commit): what each attempt moved its operation to. ``fields``: the
    attempt's log fields (class, retry_after_s, latency_s)."""
    if not event_sender.on():
        return
    for claim, outcome, to, reason, fields in applied:
        if isinstance(outcome, Succeeded):  # the common case, kept short: no text to build
            type_, event = _end_of(claim.operation_id, to, "", outcome.reference, None)
        else:
            klass, text = fields.get("class"), _scrubbed(claim, reason)
            if isinstance(outcome, RetryAt):
                waiting = outcome.waiting_for.value
                text = f"{klass}, next attempt in {outcome.delay_s:.3f}s (waiting for {waiting}): {text}"
            elif to is Status.OUTCOME_UNKNOWN:
                looked_up = lookup_name(claim.action)
                text = f"{klass}: {text}; may have executed: looked up as {looked_up}, never re-sent blindly"
            delay_s = outcome.delay_s if isinstance(outcome, RetryAt) else None
            type_, event = _operation_event(claim, to, text, reference=None, delay_s=delay_s)
        if (latency := fields.get("latency_s")) is not None:
            event["runtime"] = latency
        event_sender.send(type_, event)


# -- lookups ------------------------------------------------------------------------------------
def lookups_claimed(claims: Iterable[Claim]) -> None:
    """A reconcile doorbell claimed these operations: one lookup each is received."""
    if not event_sender.on():
        return
    for claim in claims:
        _received(lookup_uuid(claim.operation_id, claim.attempt_count), lookup_name(claim.action), claim)


def looking_up(claim: Claim) -> None:
    """The lookup leaves now."""
    if event_sender.on():
        event_sender.send(
            "task-started",
            {"uuid": lookup_uuid(claim.operation_id, claim.attempt_count), "timestamp": time.time()},
        )


def settled(item: Settled, to: Status) -> None:
    """A lookup's verdict carried out (after the commit): the lookup's own end, and the
    operation's new state on the operation's task."""
    if not event_sender.on():
        return
    claim, verdict, found = item.claim, item.verdict, item.found
    now = time.time()
    text = _scrubbed(claim, verdict.reason)
    code = f" http_{found.status_code}" if found is not None and found.status_code is not None else ""
    lookup: dict[str, Any] = {"uuid": lookup_uuid(claim.operation_id, claim.attempt_count), "timestamp": now}
    if found is not None:
        lookup["runtime"] = found.latency_s
    if to is claim.status:  # it stays: looked up again later (breaker open, a limit, not settled yet)
        delay_s = verdict.recheck_in_s
        lookup["exception"] = _exception(
            "LookAgain", f"{verdict.klass.value}{code}: {text}; next lookup in {delay_s:.3f}s"
        )
        lookup["eta"] = _eta(delay_s)
        event_sender.send("task-retried", lookup)
        return
    reference = verdict.reference or (found.provider_reference if found is not None else None)
    said = f"{to.value}" + (f" (reference {reference})" if reference else "") + f": {text}"
    lookup["result"] = said
    kind = "task-reconciliation_required" if to is Status.RECONCILIATION_REQUIRED else "task-settled"
    event_sender.send(kind, lookup)
    if to is Status.NOT_DISPATCHED:
        text = f"a lookup proved it never executed: sent again under the same key ({text})"
    type_, event = _operation_event(claim, to, text, reference=reference, delay_s=verdict.recheck_in_s)
    event_sender.send(type_, event)


def late_successes(moved: Mapping[str, Status]) -> None:
    """Operations settled by a success on record (a stale worker's answer: evidence wins)."""
    if not event_sender.on() or not moved:
        return
    for operation_id, to in moved.items():
        type_, event = _end_of(call_uuid(operation_id), to, "a success on record (evidence wins)", None, None)
        event_sender.send(type_, event)


# -- the events ---------------------------------------------------------------------------------
def _received(task_uuid: str, name: str, claim: Claim) -> None:
    event_sender.send(
        "task-received",
        {
            "uuid": task_uuid,
            "name": name,
            # The operation and its tenant: enough to find it in the console, nothing of the intent.
            "args": repr((claim.operation_id, claim.tenant)),
            "kwargs": "{}",
            "retries": max(claim.attempt_number - 1, 0),
            "eta": None,  # a retry's eta is past once the next attempt is received
            "timestamp": time.time(),
        },
    )


def _operation_event(
    claim: Claim, to: Status, text: str, *, reference: str | None, delay_s: float | None
) -> tuple[str, dict[str, Any]]:
    return _end_of(call_uuid(claim.operation_id), to, text, reference, delay_s)


def _end_of(
    task_uuid: str, to: Status, text: str, reference: str | None, delay_s: float | None
) -> tuple[str, dict[str, Any]]:
    """The event that tells the operation's task what the ledger moved it to."""
    event: dict[str, Any] = {"uuid": task_uuid, "timestamp": time.time()}
    if to in (Status.SUCCEEDED, Status.COMMITTED_EVIDENCE_DEGRADED):
        event["result"] = f"{{'status': '{to.value}', 'reference': {reference!r}}}"  # as repr() of that dict
        return "task-succeeded", event
    if to in (Status.FAILED_BEFORE_COMMIT, Status.FAILED_AT_PROVIDER):
        event["exception"] = _exception(_camel(to), text)
        event["traceback"] = f"{to.value}: {text}"
        return "task-failed", event
    if to is Status.CANCELLED:
        event.update(terminated=False, signum=None, expired=False)
        return "task-revoked", event
    if to in _CUSTOM:
        event["result"] = f"{to.value}: {text}"
        return f"task-{to.value}", event
    # not_dispatched (a retry, a re-dispatch) or awaiting_approval: it comes back to a worker.
    event["exception"] = _exception("RetryScheduled" if to is Status.NOT_DISPATCHED else _camel(to), text)
    if delay_s is not None:
        event["eta"] = _eta(delay_s)
    return "task-retried", event


def _exception(name: str, text: str) -> str:
    return f"{name}({text!r})"  # as Celery shows an exception: its class and message


def _camel(status: Status) -> str:
    return "".join(part.capitalize() for part in status.value.split("_"))


def _eta(delay_s: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=max(delay_s, 0.0))).isoformat()


def _scrubbed(claim: Claim, text: str | None) -> str:
    """``text`` without any of the intent's argument values (a provider may echo them in an error,
    a validation message may quote one), cut to MAX_TEXT."""
    if not text:
        return ""
    if claim.args:
        try:
            args = json.loads(claim.args)
        except ValueError:
            args = None
        text = Redactor.of({"args": args}, ["args"]).text(text) or ""
    return text[:MAX_TEXT]
