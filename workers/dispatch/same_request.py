"""One request per key: what an attempt may send, given what was first sent under its key.

A key names one request. A provider that compares (Stripe) answers another request under a known key
with an error; one that does not compare does what the later request says. Yet the actions file can
change while an operation waits for its retry or its lookup (another path, a ``query:``,
``decimal_args``). So (outbox/ledger/request_record.py, outbox/actions/versions.py):

- a request on record under the key is sent again exactly (method, path with query, body; the
  credentials, the fencing header and ``traceparent`` are the current ones), to the same URL, with
  its key in the same header: a target whose ``base_url`` moved since is another provider as far as
  the key goes, and a request whose key would go in another header (or in none) is not the one the
  provider holds under it;
- with nothing on record (the first attempt, or every earlier one's worker died, froze or lost its
  lease before recording what it sent), the request is built from the arguments only under the
  version of the action that every earlier attempt that may have reached the provider was claimed
  under (each attempt row records its worker's: the build is deterministic, so it is that request
  again); none may have (all not_sent, or proven absent: a fenced lookup, the provider's record, a
  person): it is the first the provider sees, under the current version;
- otherwise nothing is sent and a person decides (reconciliation_required, a handoff packet), told
  the versions: the action removed from the file, the arguments (and the request on record with
  them) purged, an earlier attempt that may have left unrecorded under another version, the key's
  header changed.

A Python hook connector (``connector:``) builds its own request: nothing of it is on record but its
digest, so a later attempt calls the hook again only under the version it was first sent under.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from outbox.ledger.claims import Claim
from outbox.ledger.request_record import RequestRecord
from outbox.ledger.states import WaitingFor
from workers.engine.outcomes import NeedsPerson, Rejected
from workers.provider.action_config import ActionConfig
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


def key_header_of(action: ActionConfig) -> str:
    """The header the action sends its idempotency key in, lower case; "" for none."""
    keys = action.provider_idempotency
    return keys.header.lower() if keys is not None else ""


def route(claim: Claim, version: str | None, *, http: bool, base_url: str | None, key_header: str = "") -> Route:
    """What this attempt sends. ``version``: the action's current version (None: the action is not in
    the actions file); ``http``: the action's connector is the HTTP one (not a hook); ``base_url``: its
    target's; ``key_header``: the header it sends the key in now (``key_header_of``)."""
    sent = claim.sent
    left = sent is not None or bool(claim.left_under)
    if version is None:
        return without_action(claim)
    if not claim.args:
        if left:
            return _person(
                claim, version, "its arguments were purged (OUTBOX_ARGS_RETENTION_S), and with them the body"
            )
        return Rejected("its arguments were purged (OUTBOX_ARGS_RETENTION_S): nothing to send")
    if sent is not None and sent.method is not None and http:
        return _resend(claim, version, sent, base_url, key_header)
    if sent is not None:
        if sent.version == version:
            return BUILD
        return _person(claim, version, "a Python hook connector built it, and its definition changed since")
    if all(v == version for v in claim.left_under):  # none may have left, or all under this version
        return BUILD
    return _person(
        claim,
        version,
        "an earlier attempt may have reached the provider and its request is not on record (its worker stopped, "
        "froze or lost its lease between sending and recording it), and it was built under another version of "
        "the action than the current one",
    )


def without_action(claim: Claim) -> NeedsPerson | Rejected:
    """``route`` for a claim whose action is not in the actions file."""
    if claim.sent is not None or claim.left_under:
        return _person(claim, None, "its action is no longer in the actions file")
    return Rejected(f"unknown action {claim.action!r}: not in the actions file")


def _resend(claim: Claim, version: str, sent: RequestRecord, base_url: str | None, key_header: str) -> Route:
    if sent.path is None or (sent.body is None and sent.method in BODY_METHODS):
        return _person(claim, version, "the request on record was purged")
    if sent.key_header is None and sent.version != version:
        # Recorded before migration 0021: only its own version says which header carried the key.
        return _person(claim, version, "the request on record does not say which header carried its key")
    if sent.key_header is not None and sent.key_header != key_header:
        return _person(
            claim, version, f"its key went {_header(sent.key_header)}, the action now sends it {_header(key_header)}"
        )
    request = recorded_request(str(sent.method), sent.path, sent.body)
    if base_url is not None and sent.digest is not None:
        url = str(httpx.URL(base_url + request.path))
        if request_digest(request.method, url, request.body) != sent.digest:
            return _person(claim, version, "its target's base_url changed since: the key belongs to the old address")
    return Resend(request)


def _header(name: str) -> str:
    return f"in header {name}" if name else "in no header"


def _person(claim: Claim, version: str | None, detail: str) -> NeedsPerson:
    return NeedsPerson(
        waiting_for=WaitingFor.REQUEST,
        why=f"the request under this key cannot be sent again as it was: {detail}; nothing was sent. "
        f"Action version: submitted under {claim.action_version or 'unknown (not recorded at submit)'}, "
        f"first request sent under {_first(claim)}, current {version or 'none (not in the actions file)'}. "
        "If the provider holds nothing under the key, resolve --as not-executed: it is then built from the "
        "current definition",
    )


def _first(claim: Claim) -> str:
    """The version the first request under the key was built under, as a person reads it."""
    if claim.sent is not None and claim.sent.version:
        return claim.sent.version
    if claim.sent is None and claim.left_under:
        known = sorted(v for v in claim.left_under if v is not None)
        said = " or ".join(known + (["an unknown one"] if None in claim.left_under else []))
        return f"{said} (not on record: the version its worker held)"
    return "unknown (none on record)"
