"""A convenience client that opens its own transaction per submit."""

from __future__ import annotations

from typing import Any, Unpack, overload

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.intent import Intent
from outbox.ledger.provider_keys import KeyRules
from outbox.ledger.submit import Receipt, submit
from outbox.runs.lifecycle import RunReceipt, submit_run
from outbox.runs.spec import StepRules
from outbox.settings import Settings, load_settings
from producer.keywords import IntentFields, as_intent


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

    @overload
    def submit(self, intent: Intent, /, *, key_rules: KeyRules | None = None) -> Receipt: ...

    @overload
    def submit(
        self, /, *, tenant: str | None = None, key_rules: KeyRules | None = None, **fields: Unpack[IntentFields]
    ) -> Receipt: ...

    def submit(
        self,
        intent: Intent | None = None,
        /,
        *,
        tenant: str | None = None,
        key_rules: KeyRules | None = None,
        **fields: Any,
    ) -> Receipt:
        """Commit one intent in a transaction of its own: an ``Intent``, or its fields as keywords
        (``producer.submit``'s; the tenant defaults to ``default_tenant``). ``key_rules``: the
        outbox's unless given."""
        if intent is None:
            tenant = tenant or self.default_tenant
        built = as_intent(intent, tenant, fields)  # before the transaction: a bad field costs no connection
        with self.sessions.begin() as session:
            return submit(session, built, key_rules=key_rules if key_rules is not None else self.key_rules)

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
