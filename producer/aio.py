"""Submit from asyncio: SQLAlchemy's ``AsyncSession`` (asyncpg, or psycopg's async connection).

``submit_async`` and ``submit_run_async`` run the very same code as ``submit`` and ``submit_run``,
on the sync session SQLAlchemy keeps under every ``AsyncSession`` (``AsyncSession.run_sync``): the
same digest and conflicts, provider keys, approvals, runs, and the relay's wake-up when the caller
commits. They never commit; your ``async with session.begin():`` does::

    async with sessions.begin() as session:         # your own transaction
        session.add(RefundRequest(order_id="o-17"))  # your own row
        receipt = await submit_async(session, tenant="acme", idempotency_key="wf-81:refund:v1",
                                     action="payments.refund.create", args={...}, subject="agent:support")

``AsyncOutbox`` mirrors ``producer.Outbox``: one transaction of its own per submit.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Unpack, overload

from outbox.errors import MissingDependency
from outbox.ledger.db import ASYNC_HINT, make_async_engine, make_async_sessionmaker

try:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
except ImportError as exc:  # SQLAlchemy's asyncio extension needs greenlet
    raise MissingDependency(f"{ASYNC_HINT} ({exc})") from exc
from outbox.ledger.intent import Intent
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.submit import Receipt, submit
from outbox.runs.lifecycle import RunReceipt
from outbox.settings import Settings, load_settings
from producer.client import action_rules_for
from producer.keywords import IntentFields, as_intent, former_rules, submit_run


def _async_session(session: Any, name: str) -> AsyncSession:
    if not isinstance(session, AsyncSession):
        sync = name.removesuffix("_async")
        raise TypeError(f"{name} takes an AsyncSession, not {type(session).__name__}: for a sync Session use {sync}")
    return session


@overload
async def submit_async(session: AsyncSession, intent: Intent, /, *, rules: SubmitRules | None = None) -> Receipt: ...


@overload
async def submit_async(
    session: AsyncSession, /, *, tenant: str, rules: SubmitRules | None = None, **fields: Unpack[IntentFields]
) -> Receipt: ...


async def submit_async(
    session: AsyncSession,
    intent: Intent | None = None,
    /,
    *,
    tenant: str | None = None,
    rules: SubmitRules | None = None,
    **fields: Any,
) -> Receipt:
    """``producer.submit`` in the caller's ``AsyncSession`` transaction: an ``Intent`` or the same
    keywords, the same receipt and errors (``IdempotencyConflict``, ``InvalidIntent``). Never commits."""
    checked = _async_session(session, "submit_async")
    rules = former_rules(rules, fields)
    built = as_intent(intent, tenant, fields)
    return await checked.run_sync(submit, built, rules=rules)


async def submit_run_async(session: AsyncSession, /, **run: Any) -> RunReceipt:
    """``producer.submit_run`` in the caller's ``AsyncSession`` transaction. Never commits."""
    return await _async_session(session, "submit_run_async").run_sync(submit_run, **run)


class AsyncOutbox:
    """Holds an async engine on the ledger; ``await submit(...)`` commits one intent in its own
    transaction. ``rules``: the actions file's rules (provider keys, approvals), as ``Outbox``."""

    def __init__(
        self, engine: AsyncEngine, *, default_tenant: str = "default", rules: SubmitRules | None = None, **former: Any
    ) -> None:
        self.engine = engine
        self.sessions: async_sessionmaker[AsyncSession] = make_async_sessionmaker(engine)
        self.default_tenant = default_tenant
        self.rules = former_rules(rules, former)  # key_rules=: its former name
        if former:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(former))}")

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> AsyncOutbox:
        """From ``OUTBOX_DATABASE_URL`` (the workers' setting, so ``postgresql+psycopg://`` or SQLite):
        a PostgreSQL ledger is opened through psycopg's async connection, the embedded SQLite file
        through aiosqlite (extra ``[asyncio]``). For asyncpg, build the engine yourself:
        ``AsyncOutbox(make_async_engine("postgresql+asyncpg://..."))``."""
        settings = settings or load_settings()
        return cls(
            make_async_engine(settings.resolved_database_url),
            default_tenant=settings.default_tenant,
            rules=action_rules_for(settings),
        )

    @overload
    async def submit(self, intent: Intent, /, *, rules: SubmitRules | None = None) -> Receipt: ...

    @overload
    async def submit(
        self, /, *, tenant: str | None = None, rules: SubmitRules | None = None, **fields: Unpack[IntentFields]
    ) -> Receipt: ...

    async def submit(
        self,
        intent: Intent | None = None,
        /,
        *,
        tenant: str | None = None,
        rules: SubmitRules | None = None,
        **fields: Any,
    ) -> Receipt:
        """``Outbox.submit`` from asyncio: one transaction of its own per intent."""
        if intent is None:
            tenant = tenant or self.default_tenant
        rules = former_rules(rules, fields)
        built = as_intent(intent, tenant, fields)
        async with self.sessions.begin() as session:
            return await submit_async(session, built, rules=rules if rules is not None else self.rules)

    async def submit_run(self, *, tenant: str | None = None, **run: Any) -> RunReceipt:
        run["rules"] = former_rules(run.get("rules"), run) or self.rules
        async with self.sessions.begin() as session:
            return await submit_run_async(session, tenant=tenant or self.default_tenant, **run)

    async def aclose(self) -> None:
        await self.engine.dispose()

    close = aclose

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
