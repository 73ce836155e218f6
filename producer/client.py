"""A convenience client that opens its own transaction per submit."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import make_engine, make_sessionmaker
from outbox.settings import Settings, load_settings
from outbox.submit import Receipt, submit


class Outbox:
    """Holds an engine on the ledger; ``submit`` commits one intent in its own transaction."""

    def __init__(self, engine: Engine, *, default_tenant: str = "default") -> None:
        self.engine = engine
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        self.default_tenant = default_tenant

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Outbox:
        settings = settings or load_settings()
        return cls(make_engine(settings.resolved_database_url), default_tenant=settings.default_tenant)

    def submit(self, *, tenant: str | None = None, **intent: Any) -> Receipt:
        with self.sessions.begin() as session:
            return submit(session, tenant=tenant or self.default_tenant, **intent)

    def close(self) -> None:
        self.engine.dispose()
