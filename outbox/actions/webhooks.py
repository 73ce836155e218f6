"""The provider's webhooks in the actions file: how a target's events are signed, and which of an
action's events settle its operations.

A target declares how its provider signs (``targets.<name>.webhooks``: the scheme, and the secret;
a tenant with an account of its own declares its own ``webhook_secret``). An action declares which
event types say what of its operations and where in an event it finds them (``actions.<name>.webhooks``):

    webhooks:
      object: data.object            # where the object sits in the event (dotted path)
      key: metadata.idempotency_key  # where our key (the provider key) sits in the object
      reference: id                  # where the provider's reference sits (default: result_reference)
      succeeded: [payout.paid]
      failed: [payout.failed]
      pending: [payout.created]

An event is mapped to an operation by our key, or by the provider's reference recorded on the
operation (its ``result_reference``). With ``match:`` (outbox/actions/matching.py, as a lookup's), the
operation so named is the event's only if the object's declared fields equal the intent's arguments
(workers/webhooks/events.py checks it); an event that names an operation it does not match is kept
as a document without record.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from outbox.actions.matching import Match, match_problem
from outbox.actions.specs import _Strict

# A dotted path of field names: data.object, metadata.idempotency_key.
_PATH = re.compile(r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")
STANDARD_PREFIX = "whsec_"
# Standard Webhooks: "a random secret of at least 24 bytes (192 bits), 512 maximum".
STANDARD_MIN_BYTES, STANDARD_MAX_BYTES = 24, 512


class WebhookOutcome(str, enum.Enum):
    """What an event says of its operation (the action's ``webhooks`` lists)."""

    SUCCEEDED = "succeeded"  # the effect is done: evidence, as a lookup that found it done
    FAILED = "failed"  # the provider took it and failed it (failed_at_provider)
    PENDING = "pending"  # still being processed: recorded, nothing moves

    def __str__(self) -> str:
        return self.value


Scheme = Literal["standard", "stripe"]


def secrets_of(value: str | list[str] | None) -> list[str]:
    """A declared secret as a list: several verify during a rotation (the new one first)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def secret_problem(scheme: Scheme, secret: str) -> str | None:
    """Why ``secret`` cannot be a secret of ``scheme`` (never quoting it), or None.

    Stripe keys its HMAC with the whole ``whsec_...`` string; Standard Webhooks strips ``whsec_`` and
    base64-decodes the rest. Mixing them up fails quietly (every event refused), so the shape is
    checked when the file loads."""
    if not secret:
        return "is empty"
    if scheme == "stripe":
        return None
    raw = secret.removeprefix(STANDARD_PREFIX).rstrip("=")
    try:
        decoded = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        return "is not a Standard Webhooks secret: whsec_ followed by base64"
    if not STANDARD_MIN_BYTES <= len(decoded) <= STANDARD_MAX_BYTES:
        return (
            f"decodes to {len(decoded)} bytes; Standard Webhooks secrets are "
            f"{STANDARD_MIN_BYTES}-{STANDARD_MAX_BYTES} random bytes, base64 after whsec_"
        )
    return None


class WebhookEndpointSpec(_Strict):
    """How a target's provider signs its webhooks (``targets.<name>.webhooks``). The signature is the
    authentication: ``POST /v1/webhooks/<target>`` takes no API key. Tolerance: 5 minutes (Standard
    Webhooks: both ways, as its library checks; Stripe: only older, as its SDK checks)."""

    scheme: Scheme
    # The target's own endpoint secret (${VAR}); a list during a rotation, the new one first. None:
    # only tenants' own secrets (tenants.<name>.webhook_secret) verify, at /v1/webhooks/<target>/<tenant>.
    secret: str | list[str] | None = Field(default=None, repr=False)

    @field_validator("scheme", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _secret_shape(self) -> WebhookEndpointSpec:
        for secret in secrets_of(self.secret):
            problem = secret_problem(self.scheme, secret)
            if problem:
                raise ValueError(f"secret {problem}")
        return self


def _path(value: str) -> str:
    if not _PATH.match(value):
        raise ValueError(f"{value!r} is not a dotted path of field names (e.g. data.object, metadata.key)")
    return value


class WebhookSpec(_Strict):
    """Which events of the target settle this action's operations, and where an event holds them."""

    # YAML key `object` (alias: a field named `object` would shadow the builtin in this class).
    object_path: str = Field(default="data", alias="object")
    type_field: str = "type"
    # Where our key (the provider key the operation was sent with) sits in the object.
    key: str | None = None
    # Where the provider's reference sits in the object; None: the action's result_reference.
    reference: str | None = None
    succeeded: list[str] = Field(default_factory=list)
    failed: list[str] = Field(default_factory=list)
    pending: list[str] = Field(default_factory=list)
    # Which fields of the event's object must equal which arguments of the intent (as lookup.match).
    match: Match = Field(default_factory=dict)

    @field_validator("match")
    @classmethod
    def _match(cls, value: Match) -> Match:
        problem = match_problem(value) if value else None
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("object_path", "type_field", "key", "reference")
    @classmethod
    def _paths(cls, value: str | None) -> str | None:
        return None if value is None else _path(value)

    @model_validator(mode="after")
    def _types(self) -> WebhookSpec:
        seen: dict[str, str] = {}
        for outcome in WebhookOutcome:
            for event_type in getattr(self, outcome.value):
                if not isinstance(event_type, str) or not event_type:
                    raise ValueError(f"{outcome.value}: event types are non-empty strings")
                if event_type in seen:
                    raise ValueError(
                        f"event type {event_type!r} is listed under both {seen[event_type]} and {outcome.value}"
                    )
                seen[event_type] = outcome.value
        if not seen:
            raise ValueError("name at least one event type under succeeded, failed or pending")
        return self

    def outcome_of(self, event_type: str) -> WebhookOutcome | None:
        for outcome in WebhookOutcome:
            if event_type in getattr(self, outcome.value):
                return outcome
        return None

    def reference_path(self, result_reference: str | None) -> str | None:
        return self.reference or result_reference
