"""A typed client of the HTTP API (``agent-outbox serve``) for Python processes that do not share
the outbox's database: another service, a sidecar. Sync (``OutboxClient``) and asyncio
(``AsyncOutboxClient``), on httpx; nothing from an optional extra, so a core install runs it.

- ``client`` / ``async_client``: the two clients, one method per API call;
- ``calls``: each request as a value (path, body, whether it may be sent again, how it is read);
- ``models``: the answers (Operation, Page, BatchItem, Run, PendingApproval, Approval, Handoff);
- ``problems``: problem+json answers as exceptions (OutboxProblem and one subclass per type);
- ``retries``: when a request is sent again (the same idempotency key, never a new one).

In-process producers use ``producer.submit`` instead: the intent then commits in their own transaction.
"""

from producer.remote.async_client import AsyncOutboxClient
from producer.remote.client import OutboxClient
from producer.remote.models import Approval, BatchItem, Handoff, Operation, Page, PendingApproval, Run
from producer.remote.problems import (
    BudgetExhausted,
    Conflict,
    Forbidden,
    IdempotencyConflict,
    InvalidInput,
    MalformedBody,
    NotConfigured,
    NotFound,
    ObjectBusy,
    OutboxProblem,
    OutboxUnreachable,
    RateLimited,
    Refused,
    RunConflict,
    SeparationOfDuties,
    SubjectStopped,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from producer.remote.retries import RetryPolicy

__all__ = [
    "Approval",
    "AsyncOutboxClient",
    "BatchItem",
    "BudgetExhausted",
    "Conflict",
    "Forbidden",
    "Handoff",
    "IdempotencyConflict",
    "InvalidInput",
    "MalformedBody",
    "NotConfigured",
    "NotFound",
    "ObjectBusy",
    "Operation",
    "OutboxClient",
    "OutboxProblem",
    "OutboxUnreachable",
    "Page",
    "PendingApproval",
    "RateLimited",
    "Refused",
    "RetryPolicy",
    "Run",
    "RunConflict",
    "SeparationOfDuties",
    "SubjectStopped",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
]
