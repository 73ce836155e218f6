"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file (no server needed).

kombu marks delivered messages invisible and never deletes them; ``cleanup`` does. Like any
broker here it may lose in-flight messages on a crash; the relay re-publishes from the ledger.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)


def broker_path(broker_url: str) -> Path:
    return Path(broker_url.split(":///", 1)[1])


def cleanup(broker_url: str) -> int:
    """Delete delivered (invisible) messages; returns how many were removed."""
    path = broker_path(broker_url)
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(path, timeout=5) as conn:
            cur = conn.execute("DELETE FROM kombu_message WHERE visible = 0")
            return cur.rowcount
    except sqlite3.OperationalError as exc:  # table not created yet, or busy: next time
        log.debug("embedded broker cleanup skipped: %s", exc)
        return 0
