"""Signed webhooks, as providers send them: an event when an object is created, and another when a
pending one settles (its clock: ``processing_s``), POSTed to ``webhook_url`` and signed with the
tenant's secret (``webhook_secrets``) or ``webhook_secret``.

The event is Stripe's shape whatever the scheme: ``{"id": "evt_...", "object": "event", "type":
"<object>.<status>", "created": <unix s>, "data": {"object": <the object as a lookup shows it>}}``; so
a refund created pending sends ``refund.pending``, then ``refund.succeeded`` (or ``refund.failed``).

- ``standard`` (Standard Webhooks): ``webhook-id`` (the event's id), ``webhook-timestamp``,
  ``webhook-signature: v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">``, keyed by the base64
  after ``whsec_``;
- ``stripe``: ``Stripe-Signature: t=<timestamp>,v1=<hex HMAC-SHA256 of "{t}.{body}">``, keyed by the
  whole secret string.

Signed here without the receiving side's library, so a test checks two implementations against each
other. Timestamps are the real wall clock (the receiver's tolerance is judged on its own), never the
sandbox's movable clock. Each event is POSTed once (``/admin/webhooks/{id}/redeliver`` sends it
again, freshly signed, as a provider's retry); ``webhooks_held`` keeps them until released.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from workers.sandbox.config import SandboxConfig
from workers.sandbox.store import StoredObject

log = logging.getLogger(__name__)

# How often the sender looks for pending objects that settled (the clock may jump: advance_clock).
TICK_S = 0.05
SEND_TIMEOUT_S = 10.0  # Standard Webhooks recommends 15-30 s; tests want a stuck receiver seen sooner


def sign_standard(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_") + "==")
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def sign_stripe(secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def signed_headers(
    scheme: str, secret: str, event_id: str, body: bytes, timestamp: int | None = None
) -> dict[str, str]:
    """The headers that sign ``body`` under ``scheme`` (``timestamp``: now)."""
    ts = int(time.time()) if timestamp is None else timestamp
    headers = {"Content-Type": "application/json"}
    if scheme == "stripe":
        headers["Stripe-Signature"] = sign_stripe(secret, ts, body)
    else:
        headers |= {
            "webhook-id": event_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": sign_standard(secret, event_id, ts, body),
        }
    return headers


@dataclass
class Delivery:
    """One event and what became of its sending (what /admin/webhooks shows)."""

    id: int
    event_id: str
    type: str
    tenant: str
    object_id: str
    body: bytes
    url: str = ""
    scheme: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    status: int | str | None = None  # the receiver's HTTP status, an error, or None (held / not sent yet)
    sent_at: float | None = None
    attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event_id": self.event_id,
            "type": self.type,
            "tenant": self.tenant,
            "object_id": self.object_id,
            "url": self.url,
            "scheme": self.scheme,
            "headers": self.headers,
            "body": self.body.decode(),
            "status": self.status,
            "sent_at": self.sent_at,
            "attempts": self.attempts,
        }


@dataclass
class WebhookBook:
    """Events made, waiting, sent; and the pending objects whose settling will make one."""

    deliveries: list[Delivery] = field(default_factory=list)
    outbox: list[Delivery] = field(default_factory=list)  # to send on the next tick (unless held)
    resend: list[Delivery] = field(default_factory=list)  # redeliveries: sent on the next tick, held or not
    settling: list[StoredObject] = field(default_factory=list)
    releasing: bool = False  # release() asked: send what is held on the next tick
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    wake: asyncio.Event | None = None

    def created(self, config: SandboxConfig, obj: StoredObject, now: float) -> None:
        if not config.webhook_url:
            return
        self._event(obj, now)
        if now < obj.settles_at:
            self.settling.append(obj)

    def settled(self, now: float) -> None:
        """An event for every pending object whose clock has run out."""
        done = [o for o in self.settling if now >= o.settles_at]
        if done:
            self.settling = [o for o in self.settling if now < o.settles_at]
            for obj in done:
                self._event(obj, now)

    def _event(self, obj: StoredObject, now: float) -> None:
        rendered = obj.render(now)
        event_id = f"evt_{secrets.token_hex(12)}"
        kind = f"{obj.spec.object}.{rendered['status']}"
        event = {
            "id": event_id,
            "object": "event",
            "type": kind,
            "created": int(time.time()),
            "data": {"object": rendered},
        }
        delivery = Delivery(next(self.seq), event_id, kind, obj.tenant, obj.id, json.dumps(event).encode())
        self.deliveries.append(delivery)
        self.outbox.append(delivery)
        if self.wake is not None:
            self.wake.set()

    def release(self) -> int:
        """Send what is held (webhooks_held) on the next tick; how many."""
        self.releasing = True
        if self.wake is not None:
            self.wake.set()
        return len(self.outbox)

    def redeliver(self, delivery_id: int) -> Delivery | None:
        """Send an event again (the same id and body, signed anew): a provider's retry."""
        found = next((d for d in self.deliveries if d.id == delivery_id), None)
        if found is not None:
            self.resend.append(found)
            if self.wake is not None:
                self.wake.set()
        return found


async def _send(session: Any, config: SandboxConfig, delivery: Delivery) -> None:
    import aiohttp

    secret = config.webhook_secrets.get(delivery.tenant, config.webhook_secret)
    delivery.url = config.webhook_url.replace("{tenant}", delivery.tenant)
    delivery.scheme = config.webhook_scheme
    delivery.headers = signed_headers(config.webhook_scheme, secret, delivery.event_id, delivery.body)
    delivery.attempts += 1
    try:
        timeout = aiohttp.ClientTimeout(total=SEND_TIMEOUT_S)
        async with session.post(delivery.url, data=delivery.body, headers=delivery.headers, timeout=timeout) as answer:
            await answer.read()
            delivery.status = answer.status
    except Exception as exc:  # noqa: BLE001 - a receiver that is down is what the log is for
        delivery.status = f"error: {type(exc).__name__}"
    delivery.sent_at = time.time()


async def run_sender(state: Any, stop: asyncio.Event) -> None:
    """The sandbox's sender: every tick (or at once when woken), make the settled objects' events and
    POST what waits, unless held. Reads ``state.webhooks`` afresh each time (a reset replaces it)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            book: WebhookBook = state.webhooks
            if book.wake is None:
                book.wake = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(book.wake.wait(), TICK_S)
            book.wake.clear()
            book.settled(state.clock.now())
            config: SandboxConfig = state.config
            waiting, book.resend = book.resend, []
            if not config.webhooks_held or book.releasing:
                waiting, book.outbox, book.releasing = waiting + book.outbox, [], False
            for delivery in waiting:
                try:
                    await _send(session, config, delivery)
                except Exception:  # noqa: BLE001 - one bad event must not stop the sender
                    log.warning("webhook not sent", exc_info=True)
