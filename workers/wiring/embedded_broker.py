"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file (no server needed).

kombu marks delivered messages invisible and never deletes them; ``cleanup`` does. Like any
broker here it may lose in-flight messages on a crash; the relay re-publishes from the ledger.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import column, create_engine, delete, table
from sqlalchemy.exc import OperationalError

log = logging.getLogger(__name__)

# kombu's own table (kombu.transport.sqlalchemy), not the ledger's.
_MESSAGES = table("kombu_message", column("visible"))


def broker_path(broker_url: str) -> Path:
    return Path(broker_url.split(":///", 1)[1])


def cleanup(broker_url: str) -> int:
    """Delete delivered (invisible) messages; returns how many were removed."""
    path = broker_path(broker_url)
    if not path.exists():
        return 0
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 5})
    try:
        with engine.begin() as conn:
            return conn.execute(delete(_MESSAGES).where(_MESSAGES.c.visible == 0)).rowcount
    except OperationalError as exc:  # table not created yet, or busy: next time
        log.debug("embedded broker cleanup skipped: %s", exc)
        return 0
    finally:
        engine.dispose()
