"""A convenience client that opens its own transaction per submit."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.provider_keys import KeyRules
from outbox.ledger.submit import Receipt, submit
from outbox.runs.lifecycle import RunReceipt, submit_run
from outbox.runs.spec import StepRules
from outbox.settings import Settings, load_settings


class Outbox:
    """Holds an engine on the ledger; ``submit`` commits one intent in its own transaction.

    ``key_rules``: the actions file (workers.provider.actions.ActionsConfig), so each action's
    ``provider_key`` template applies; None: the default ``{tenant}:{idempotency_key}``.
    """

    def __init__(self, engine: Engine, *, default_tenant: str = "default", key_rules: KeyRules | None = None) -> None:
        self.engine = engine
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        self.default_tenant = default_tenant
        self.key_rules = key_rules

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Outbox:
        settings = settings or load_settings()
        return cls(
            make_engine(settings.resolved_database_url),
            default_tenant=settings.default_tenant,
            key_rules=key_rules_for(settings),
        )

    def submit(self, *, tenant: str | None = None, **intent: Any) -> Receipt:
        intent.setdefault("key_rules", self.key_rules)
        with self.sessions.begin() as session:
            return submit(session, tenant=tenant or self.default_tenant, **intent)

    def submit_run(self, *, tenant: str | None = None, **run: Any) -> RunReceipt:
        run.setdefault("key_rules", self.key_rules)
        with self.sessions.begin() as session:
            return submit_run(session, tenant=tenant or self.default_tenant, **run)

    def close(self) -> None:
        self.engine.dispose()


def key_rules_for(settings: Settings) -> StepRules | None:
    """The rules a producer applies at submit (provider keys, approvals) from the actions file named
    by OUTBOX_ACTIONS_FILE, or None. The targets' secrets are neither needed nor read."""
    if settings.actions_file is None:
        return None
    from outbox.actions.rules import load_intent_rules

    return load_intent_rules(settings.actions_file)
