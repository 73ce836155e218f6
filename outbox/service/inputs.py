"""What a person writes into the ledger through any surface: text the database can store, within
the length its column (and the API's documented schema) allows."""

from __future__ import annotations

from outbox.errors import InvalidIntent
from outbox.ledger.intent import require_storable

# The limits the API documents for the same fields (workers/server/operators.py uses these).
BY_MAX = 200  # the approver or resolver; room left for " (api:key-<id>)" in a 255 column
NOTE_MAX = 4000
REFERENCE_MAX = 255


def written(field: str, value: str | None, *, max_len: int, required: bool = False) -> str | None:
    """``value`` as the ledger may keep it, or InvalidIntent naming ``field``."""
    if value is None:
        if required:
            raise InvalidIntent(field, "required")
        return None
    require_storable(field, value)
    if required and not value.strip():
        raise InvalidIntent(field, "required")
    if len(value) > max_len:
        raise InvalidIntent(field, f"at most {max_len} characters")
    return value
