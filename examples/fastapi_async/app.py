"""A FastAPI service that asks for refunds in its own transaction: SQLAlchemy AsyncSession + asyncpg.

``POST /refunds`` writes the service's own row (``app_refund_requests``: one refund request per
order) and submits the refund intent to the outbox in the SAME transaction. Both commit, or neither:
a second request for an order fails on the service's own unique constraint after it submitted, and
its intent rolls back with it (409, nothing sent, no doorbell rung). The outbox's relay and workers
send the committed ones (docs/how-to/deploy.md).

Run it (a PostgreSQL ledger, migrated with ``agent-outbox migrate``)::

    pip install 'agent-outbox-ledger[asyncpg]' fastapi uvicorn
    APP_DATABASE_URL=postgresql+asyncpg://outbox:outbox@127.0.0.1:5432/outbox \\
        uvicorn --app-dir examples/fastapi_async app:app
    curl -s -X POST localhost:8000/refunds -H 'Content-Type: application/json' \\
        -d '{"request_id": "req-1", "order_id": "o-17", "amount": "25.00"}'

tests/integration/agents/test_fastapi_example.py runs it offline against a database of its own.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations at run time, and
# their dependency (`session`) is local to create_app.
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Response
from pydantic import BaseModel, Field
from sqlalchemy import Numeric, String, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from producer import IdempotencyConflict, submit_async

TENANT = "acme"


class Base(DeclarativeBase):
    """The service's own tables (its own MetaData, beside the ledger's ``outbox_*`` tables)."""


class RefundRequest(Base):
    __tablename__ = "app_refund_requests"

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    order_id: Mapped[str] = mapped_column(String(64), unique=True)  # one refund request per order
    amount: Mapped[Decimal] = mapped_column(Numeric(12, 2))
    operation_id: Mapped[str] = mapped_column(String(36))


class RefundIn(BaseModel):
    request_id: str = Field(min_length=1, max_length=64)  # the caller's retry-safe id
    order_id: str = Field(min_length=1, max_length=64)
    amount: Decimal = Field(gt=0, decimal_places=2)


def create_app(database_url: str) -> FastAPI:
    engine = create_async_engine(database_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()

    async def session() -> AsyncIterator[AsyncSession]:
        async with sessions() as s:
            yield s

    app = FastAPI(title="refunds", lifespan=lifespan)

    @app.post("/refunds", status_code=201)
    async def request_refund(
        body: RefundIn, response: Response, s: Annotated[AsyncSession, Depends(session)]
    ) -> dict[str, Any]:
        try:
            async with s.begin():  # ONE transaction: the intent and the service's row
                receipt = await submit_async(
                    s,
                    tenant=TENANT,
                    idempotency_key=f"refund:{body.request_id}",  # stable across the caller's retries
                    action="payments.refund.create",
                    args={"order_id": body.order_id, "amount": body.amount, "currency": "EUR"},
                    subject="service:refunds",
                )
                if receipt.new:
                    s.add(RefundRequest(**body.model_dump(), operation_id=receipt.operation_id))
                    await s.flush()  # the service's own rule: a second request for the order fails here
        except IdempotencyConflict as exc:
            raise HTTPException(409, f"request {body.request_id} was already made with other arguments") from exc
        except IntegrityError as exc:
            # Rolled back: the intent submitted above is gone with the row, and nothing will be sent.
            raise HTTPException(409, f"order {body.order_id} already has a refund request") from exc
        if not receipt.new:
            response.status_code = 200  # the caller's retry: the same request, the same operation
        return {"request_id": body.request_id, "operation_id": receipt.operation_id, "status": receipt.status}

    @app.get("/refunds/{request_id}")
    async def show_refund(request_id: str, s: Annotated[AsyncSession, Depends(session)]) -> dict[str, Any]:
        row = (
            await s.execute(select(RefundRequest).where(RefundRequest.request_id == request_id))
        ).scalar_one_or_none()
        if row is None:
            raise HTTPException(404, f"no refund request {request_id}")
        return {
            "request_id": row.request_id,
            "order_id": row.order_id,
            "amount": str(row.amount),
            "operation_id": row.operation_id,
        }

    return app


app = create_app(os.environ.get("APP_DATABASE_URL", "postgresql+asyncpg://outbox:outbox@127.0.0.1:5432/outbox"))
