"""The provider's object store: created refunds, tickets and emails, with index lag on reads.

Objects outlive idempotency keys: a lookup by key reads the key stored on the object, which a
provider keeps forever, while the replay cache (idempotency.py) forgets keys after retention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.sandbox.resources import ResourceSpec


@dataclass
class StoredObject:
    id: str
    spec: ResourceSpec
    tenant: str
    idempotency_key: str | None
    params: dict[str, Any]
    created: float
    settles_at: float  # == created unless processing is on
    seq: int
    fails: bool = False  # processing ends "failed" (sandbox.config processing_fails)

    def status(self, now: float) -> str:
        if now < self.settles_at:
            return "pending"
        return "failed" if self.fails else self.spec.final_status

    def render(self, now: float) -> dict[str, Any]:
        status = self.status(now)
        return {
            "id": self.id,
            "object": self.spec.object,
            "status": status,
            **self.params,
            "idempotency_key": self.idempotency_key,
            "created": self.created,
        }


@dataclass
class ObjectStore:
    by_id: dict[str, StoredObject] = field(default_factory=dict)
    # (tenant, resource, key) -> objects in creation order; several only without idempotency.
    by_key: dict[tuple[str, str, str], list[StoredObject]] = field(default_factory=dict)
    ordered: list[StoredObject] = field(default_factory=list)

    def add(self, obj: StoredObject) -> None:
        self.by_id[obj.id] = obj
        self.ordered.append(obj)
        if obj.idempotency_key is not None:
            self.by_key.setdefault((obj.tenant, obj.spec.name, obj.idempotency_key), []).append(obj)

    def get(self, tenant: str, resource: str, object_id: str, now: float, lag_s: float) -> StoredObject | None:
        obj = self.by_id.get(object_id)
        if obj is None or obj.tenant != tenant or obj.spec.name != resource:
            return None
        return obj if _visible(obj, now, lag_s) else None

    def find_by_key(self, tenant: str, resource: str, key: str, now: float, lag_s: float) -> StoredObject | None:
        """The newest visible object created with this key; index lag hides fresh ones."""
        for obj in reversed(self.by_key.get((tenant, resource, key), [])):
            if _visible(obj, now, lag_s):
                return obj
        return None

    def list(
        self,
        tenant: str,
        resource: str,
        now: float,
        lag_s: float,
        created_after: float | None,
        starting_after: str | None,
        limit: int,
        filters: dict[str, str] | None = None,
    ) -> tuple[list[StoredObject], bool]:
        """Oldest first, so a reconciler pages forward from its watermark. ``filters``: fields the
        object must hold, compared as text (order_id=o-1)."""
        start_seq = -1
        if starting_after is not None:
            cursor = self.by_id.get(starting_after)
            start_seq = cursor.seq if cursor is not None else -1
        page: list[StoredObject] = []
        for obj in self.ordered:
            if obj.seq <= start_seq or obj.tenant != tenant or obj.spec.name != resource:
                continue
            if created_after is not None and obj.created <= created_after:
                continue
            if not _visible(obj, now, lag_s):
                continue
            if filters and any(str(obj.params.get(k)) != v for k, v in filters.items()):
                continue
            if len(page) == limit:
                return page, True
            page.append(obj)
        return page, False


def _visible(obj: StoredObject, now: float, lag_s: float) -> bool:
    return now >= obj.created + lag_s
