"""Alembic environment: the URL comes from the caller (``outbox.migrate``), never from a file."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from outbox.ledger.models import Base

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        version_table="outbox_alembic_version",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - outbox.migrate always passes a connection
    raise RuntimeError("run migrations through `agent-outbox migrate`")
_run(connection)
