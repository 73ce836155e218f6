"""Receiving a provider's webhook: which endpoint it came to, which secrets verify it there, what the
actions file reads in it, and the ledger's fenced evidence path for what it says.

Endpoints: ``/v1/webhooks/<target>`` verifies with the target's own secret (``webhooks.secret``) and
may settle the operations of any tenant except the walled ones: those with a provider account of their
own (``tenants.<name>.headers``: another account signs their events) and those with a ``webhook_secret``
of their own. ``/v1/webhooks/<target>/<tenant>`` exists only for a tenant listed under ``tenants``: it
verifies with that tenant's ``webhook_secret``, or, for a tenant without an account of its own (it
shares the platform's), with the target's; it settles that tenant's operations only. A tenant with an
account of its own and no ``webhook_secret`` has no endpoint: the target's secret never verifies its
events. So a tenant's secret never verifies an event of another tenant's endpoint, and an event verified
there never names another tenant's operation. Every "no endpoint here" (unknown target, unknown tenant,
a tenant without a secret) is the same 404 with the same body: the answer tells nobody which tenants
exist or have a secret of their own. An event is kept once per (target, whose secret verified it, event
id), whatever path it was posted to.

The actions file is read again when it changes (a secret rotated in the file takes effect at once;
one given through ``${VAR}`` with the process's environment).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from outbox.errors import NotFound
from outbox.evidence import webhooks as ledger
from outbox.evidence.sinks import EvidenceSink
from outbox.settings import Settings
from workers.engine.handoff_packet import packet_builder
from workers.provider.actions import ActionsFile, TargetConfig
from workers.webhooks import metrics
from workers.webhooks.events import event_type, owner_check, readings, redactor_for
from workers.webhooks.signatures import WebhookRefused, verify
from workers.wiring.builders import load_actions_for

log = logging.getLogger(__name__)
TENANT_MAX = 128  # the ledger's tenant column


class EndpointNotFound(NotFound):
    """No webhook endpoint here: the target is unknown, receives no webhooks, or has no secret for it.
    Its message is the same for every case (the answer's body); ``why`` says which, for the log."""

    what = "webhook endpoint"
    PUBLIC = "no webhook endpoint at this path"

    def __init__(self, why: str) -> None:
        super().__init__(self.PUBLIC)
        self.why = why


@dataclass(frozen=True)
class Answer:
    """What the endpoint answers a verified event (2xx: the provider stops retrying it)."""

    event_id: str
    duplicate: bool
    disposition: str

    def as_json(self) -> dict[str, object]:
        return {"event_id": self.event_id, "duplicate": self.duplicate, "disposition": self.disposition}


class WebhookReceiver:
    """One per server process: the ledger's sessions, the evidence sink, the actions file (cached)."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session]) -> None:
        self.settings, self.sessions = settings, sessions
        self.sink = EvidenceSink.from_url(settings.evidence_url)
        self._actions: tuple[tuple[int, int], ActionsFile] | None = None
        self._lock = threading.Lock()

    def actions(self) -> ActionsFile:
        """The actions file, read again when its size or modification time changed."""
        path = self.settings.actions_file
        stat = os.stat(path) if path is not None else None
        stamp = (stat.st_mtime_ns, stat.st_size) if stat is not None else (0, 0)
        with self._lock:
            if self._actions is None or self._actions[0] != stamp:
                self._actions = (stamp, load_actions_for(self.settings))
            return self._actions[1]

    def receive(self, target: str, tenant: str | None, headers: Mapping[str, str], body: bytes) -> Answer:
        """Verify, read and apply one webhook request. EndpointNotFound (404), WebhookRefused (400/401):
        nothing stored."""
        actions = self.actions()
        cfg = actions.targets.get(target)
        label = target if cfg is not None else None
        try:
            scheme, secrets, owner = _endpoint(cfg, target, tenant)
            verified = verify(scheme, secrets, headers, body, now_s=time.time())
        except EndpointNotFound as missing:
            metrics.record(label, rejected="endpoint")
            log.warning("webhook refused: %s", missing.why, extra={"target": target[:200], "status": 404})
            raise
        except WebhookRefused as refused:
            metrics.record(label, rejected=refused.why)
            log.warning(
                "webhook refused: %s",
                refused.detail,
                extra={"target": target, "tenant": tenant, "status": refused.status, "why": refused.why},
            )
            raise
        assert cfg is not None
        event = ledger.ReceivedEvent(
            target=target,
            scope=tenant,
            verified_by=owner,
            event_id=verified.event_id[:255],
            event_type=event_type(actions, target, verified.payload),
            scheme=scheme,
            signed_at=verified.signed_at,
            body_digest=hashlib.sha256(body).hexdigest(),
            readings=readings(actions, target, verified.payload),
            exclude_tenants=cfg.walled_tenants if tenant is None else (),
        )
        with self.sessions.begin() as session:
            received = ledger.receive(
                session,
                event,
                actor=f"webhook:{target}",
                sink=self.sink,
                packet=packet_builder(actions),
                owns=owner_check(actions),
                result_of=redactor_for(actions),
            )
        disposition = received.disposition.value
        metrics.record(target, disposition="duplicate" if received.duplicate else disposition)
        log.info(
            "webhook %s: %s",
            "duplicate" if received.duplicate else disposition,
            received.note,
            extra={
                "target": target,
                "tenant": tenant,
                "event_id": event.event_id,
                "event_type": event.event_type,
                "operation_id": received.operation_id,
            },
        )
        return Answer(event.event_id, received.duplicate, disposition)


def _endpoint(cfg: TargetConfig | None, target: str, tenant: str | None) -> tuple[str, list[str], str]:
    """(the scheme, the secrets, whose they are: "" the target's) that verify an event at this endpoint;
    EndpointNotFound if none (the same answer whatever the reason: ``why`` is for the log only)."""
    if cfg is None or cfg.webhooks is None:
        raise EndpointNotFound(f"target {target[:200]!r} receives no webhooks (targets.<name>.webhooks)")
    if tenant is not None and not 0 < len(tenant) <= TENANT_MAX:
        raise EndpointNotFound(
            f"no webhook endpoint of target {target!r} for a tenant name of {len(tenant)} characters"
        )
    owner = cfg.webhook_secret_owner(tenant)
    if owner is None:
        raise EndpointNotFound(
            f"target {target!r} has no webhook secret of its own: its tenants receive at /v1/webhooks/{target}/<tenant>"
            if tenant is None
            else f"target {target!r} has no webhook endpoint for tenant {tenant[:TENANT_MAX]!r}: not listed under "
            "tenants, or an account of its own without a webhook_secret"
        )
    return cfg.webhooks.scheme, cfg.webhook_secrets(tenant), owner
