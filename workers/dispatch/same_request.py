"""One request per key: what an attempt may send, given what was first sent under its key.

A key names one request. A provider that compares (Stripe) answers another request under a known key
with an error; one that does not compare does what the later request says. Yet the actions file can
change while an operation waits for its retry or its lookup (another path, a ``query:``,
``decimal_args``). So (outbox/ledger/request_record.py, outbox/actions/versions.py):

- a request on record under the key is sent again exactly (method, path with query, body; the
  credentials, the idempotency and fencing headers and ``traceparent`` are the current ones), to the
  same URL: a target whose ``base_url`` moved since is another provider as far as the key goes;
- with nothing on record, the request is built from the arguments only under the version the
  operation was submitted under (the build is deterministic), or when no earlier attempt under the
  key can have reached the provider (all not_sent, or proven absent: a fenced lookup, a person):
  then it is the first the provider sees, under the current version;
- otherwise nothing is sent and a person decides (reconciliation_required, a handoff packet), told
  both versions: the action removed from the file, the arguments (and the request on record with
  them) purged, or another version while an earlier attempt may have left unrecorded (its worker
  died between the send and the finalize).

A Python hook connector (``connector:``) builds its own request: nothing of it is on record but its
digest, so a later attempt calls the hook again only under the version it was first sent under.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from outbox.ledger.claims import Claim
from outbox.ledger.request_record import RequestRecord
from outbox.ledger.states import WaitingFor
from workers.dispatch.outcomes import NeedsPerson, Rejected
from workers.provider.http_request import BODY_METHODS, PreparedRequest, recorded_request, request_digest


@dataclass(frozen=True)
class Resend:
    """Send the request on record as it is."""

    request: PreparedRequest


@dataclass(frozen=True)
class Build:
    """Build the request from the arguments, under the current definition."""


BUILD = Build()
Route = Resend | Build | NeedsPerson | Rejected


def needs_check(claim: Claim, version: str | None) -> bool:
    """Whether this claim's route depends on its earlier attempts (``route``'s ``earlier_left``): only
    when nothing is on record and the request could otherwise not be built as submitted. A read
    that the hot path never makes: a first attempt, or a retry under an unchanged definition, skips it."""
    if claim.sent is not None or claim.attempt_number <= 1:
        return False
    changed = claim.action_version is not None and claim.action_version != version
    return version is None or not claim.args or changed


def route(claim: Claim, version: str | None, *, http: bool, base_url: str | None, earlier_left: bool) -> Route:
    """What this attempt sends. ``version``: the action's current version (None: the action is not in
    the actions file); ``http``: the action's connector is the HTTP one (not a hook); ``base_url``: its
    target's; ``earlier_left``: an earlier attempt, not proven absent, may have reached the provider
    with nothing on record (asked only where ``needs_check`` says so)."""
    sent = claim.sent
    left = sent is not None or earlier_left
    if version is None:
        return without_action(claim, earlier_left=earlier_left)
    if not claim.args:
        if left:
            return _person(
                claim, version, "its arguments were purged (OUTBOX_ARGS_RETENTION_S), and with them the body"
            )
        return Rejected("its arguments were purged (OUTBOX_ARGS_RETENTION_S): nothing to send")
    if sent is not None and sent.method is not None and http:
        return _resend(claim, version, sent, base_url)
    if sent is not None:
        if sent.version == version:
            return BUILD
        return _person(claim, version, "a Python hook connector built it, and its definition changed since")
    if claim.action_version is None or claim.action_version == version or not earlier_left:
        return BUILD
    return _person(
        claim,
        version,
        "an earlier attempt may have reached the provider and its request is not on record (its worker stopped "
        "between sending and recording it), and the action's definition changed since",
    )


def without_action(claim: Claim, *, earlier_left: bool) -> NeedsPerson | Rejected:
    """``route`` for a claim whose action is not in the actions file."""
    if claim.sent is not None or earlier_left:
        return _person(claim, None, "its action is no longer in the actions file")
    return Rejected(f"unknown action {claim.action!r}: not in the actions file")


def _resend(claim: Claim, version: str, sent: RequestRecord, base_url: str | None) -> Route:
    if sent.path is None or (sent.body is None and sent.method in BODY_METHODS):
        return _person(claim, version, "the request on record was purged")
    request = recorded_request(str(sent.method), sent.path, sent.body)
    if base_url is not None and sent.digest is not None:
        url = str(httpx.URL(base_url + request.path))
        if request_digest(request.method, url, request.body) != sent.digest:
            return _person(claim, version, "its target's base_url changed since: the key belongs to the old address")
    return Resend(request)


def _person(claim: Claim, version: str | None, detail: str) -> NeedsPerson:
    sent = claim.sent
    return NeedsPerson(
        waiting_for=WaitingFor.REQUEST,
        why=f"the request under this key cannot be sent again as it was: {detail}; nothing was sent. "
        f"Action version: submitted under {claim.action_version or 'unknown (not recorded at submit)'}, "
        f"first request sent under {sent.version if sent and sent.version else 'unknown (none on record)'}, "
        f"current {version or 'none (not in the actions file)'}. If the provider holds nothing under the key, "
        "resolve --as not-executed: it is then built from the current definition",
    )
