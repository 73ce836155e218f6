"""A convenience client that opens its own transaction per submit."""

from __future__ import annotations

from typing import Any, Unpack, overload

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.ledger.db import make_engine, make_sessionmaker
from outbox.ledger.intent import Intent
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.submit import Receipt, submit
from outbox.runs.lifecycle import RunReceipt, submit_run
from outbox.runs.spec import StepRules
from outbox.settings import Settings, load_settings
from producer.keywords import IntentFields, as_intent, former_rules


class Outbox:
    """Holds an engine on the ledger; ``submit`` commits one intent in its own transaction.

    ``rules``: the actions file (workers.provider.actions.ActionsFile), so each action's
    ``provider_key`` template applies; None: the default ``{tenant}:{idempotency_key}``.
    """

    def __init__(
        self, engine: Engine, *, default_tenant: str = "default", rules: SubmitRules | None = None, **former: Any
    ) -> None:
        self.engine = engine
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        self.default_tenant = default_tenant
        self.rules = former_rules(rules, former)  # key_rules=: its former name
        if former:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(former))}")

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Outbox:
        settings = settings or load_settings()
        return cls(
            make_engine(settings.resolved_database_url),
            default_tenant=settings.default_tenant,
            rules=action_rules_for(settings),
        )

    @overload
    def submit(self, intent: Intent, /, *, rules: SubmitRules | None = None) -> Receipt: ...

    @overload
    def submit(
        self, /, *, tenant: str | None = None, rules: SubmitRules | None = None, **fields: Unpack[IntentFields]
    ) -> Receipt: ...

    def submit(
        self,
        intent: Intent | None = None,
        /,
        *,
        tenant: str | None = None,
        rules: SubmitRules | None = None,
        **fields: Any,
    ) -> Receipt:
        """Commit one intent in a transaction of its own: an ``Intent``, or its fields as keywords
        (``producer.submit``'s; the tenant defaults to ``default_tenant``). ``rules``: the
        outbox's unless given."""
        if intent is None:
            tenant = tenant or self.default_tenant
        rules = former_rules(rules, fields)
        built = as_intent(intent, tenant, fields)  # before the transaction: a bad field costs no connection
        with self.sessions.begin() as session:
            return submit(session, built, rules=rules if rules is not None else self.rules)

    def submit_run(self, *, tenant: str | None = None, **run: Any) -> RunReceipt:
        run["rules"] = former_rules(run.get("rules"), run) or self.rules
        with self.sessions.begin() as session:
            return submit_run(session, tenant=tenant or self.default_tenant, **run)

    def close(self) -> None:
        self.engine.dispose()


def action_rules_for(settings: Settings) -> StepRules | None:
    """The rules a producer applies at submit (provider keys, approvals) from the actions file named
    by OUTBOX_ACTIONS_FILE, or None. The targets' secrets are neither needed nor read."""
    if settings.actions_file is None:
        return None
    from outbox.actions.rules import load_action_rules

    return load_action_rules(settings.actions_file)
