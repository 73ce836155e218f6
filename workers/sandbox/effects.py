"""The effects ledger: one row per object the provider created, i.e. per effect on the world.

Tests count effects here, never in log lines (FAULTS.md). `duplicates()` groups effects that
share a business key: the idempotency key by default, or the parameters digest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Effect:
    seq: int
    object_id: str
    resource: str
    tenant: str
    idempotency_key: str | None
    params_digest: str
    fencing_token: int | None
    created: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


GROUPINGS = ("key", "params")


@dataclass
class EffectsLedger:
    rows: list[Effect] = field(default_factory=list)

    def record(self, effect: Effect) -> None:
        self.rows.append(effect)

    def filter(self, resource: str | None = None, key: str | None = None, tenant: str | None = None) -> list[Effect]:
        return [
            e
            for e in self.rows
            if (resource is None or e.resource == resource)
            and (key is None or e.idempotency_key == key)
            and (tenant is None or e.tenant == tenant)
        ]

    def duplicates(self, by: str = "key") -> list[dict[str, Any]]:
        """Groups of two or more effects with the same (tenant, resource, business key)."""
        groups: dict[tuple[str, str, str], list[Effect]] = {}
        for e in self.rows:
            business_key = e.idempotency_key if by == "key" else e.params_digest
            if business_key is None:
                continue  # without a key there is no business identity to compare
            groups.setdefault((e.tenant, e.resource, business_key), []).append(e)
        return [
            {
                "tenant": tenant,
                "resource": resource,
                "business_key": business_key,
                "count": len(rows),
                "object_ids": [e.object_id for e in rows],
            }
            for (tenant, resource, business_key), rows in groups.items()
            if len(rows) > 1
        ]
