"""What the HTTP API refuses, as exceptions: one per problem ``type`` the server sends.

Every refusal of the API is RFC 9457 ``application/problem+json``: ``type``, ``title``, ``status``,
``detail`` and, when one field is to blame, ``field`` (producer/http/problems.py, workers/server/app.py).
``raise_for_answer`` turns such an answer into the subclass of ``OutboxProblem`` its type names; a type
this client does not know (a newer server) is still an ``OutboxProblem`` with every member kept in
``body``. An error answer that is not problem+json (a proxy's HTML page) becomes one too, typed by its
status.

``OutboxUnreachable`` is not the server's word: the request failed on the way, or its answer was lost.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import httpx

from outbox.errors import OutboxError

# The server's type URIs are PROBLEM_BASE + kind (producer/http/problems.py says the same).
PROBLEM_BASE = "https://agent-outbox.dev/problems/"


class OutboxProblem(OutboxError):
    """The API refused the request; ``type``, ``title``, ``status``, ``detail`` and ``field`` are the
    problem's members, ``kind`` the last segment of its type, ``body`` every member it carried."""

    def __init__(
        self,
        *,
        type: str,
        title: str,
        status: int,
        detail: str,
        field: str | None = None,
        body: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        where = f" ({field})" if field else ""
        super().__init__(f"{status} {title}: {detail}{where}")
        self.type, self.title, self.status, self.detail, self.field = type, title, status, detail, field
        self.body: dict[str, Any] = body if body is not None else {}
        self.retry_after_s = retry_after_s  # the answer's Retry-After, in seconds, when it had one

    @property
    def kind(self) -> str:
        """``invalid``, ``not-found``, ``idempotency-conflict``... (the type's last path segment)."""
        return self.type.rstrip("/").rsplit("/", 1)[-1]


class InvalidInput(OutboxProblem):
    """422: the request breaks a rule; ``field`` names the field (``args``, ``intents.2.args``, ``by``)."""


class MalformedBody(InvalidInput):
    """400: the body was not JSON at all (``field`` is ``body``)."""


class TooLarge(OutboxProblem):
    """413: the body is over the server's limit (OUTBOX_API_MAX_BODY_BYTES)."""


class Unauthorized(OutboxProblem):
    """401: no key, or an unknown or revoked one."""


class Forbidden(OutboxProblem):
    """403: the key lacks the scope the route needs."""


class SeparationOfDuties(Forbidden):
    """403: the identity that submitted the intent may not approve it (the action's separate_approver)."""


class NotFound(OutboxProblem):
    """404: nothing with that id for this key's tenant (another tenant's record is not found either)."""


class Conflict(OutboxProblem):
    """409: the state does not allow it (the operation or run moved on meanwhile: read it again)."""


class IdempotencyConflict(Conflict):
    """409: the idempotency key was already used for an intent with different arguments.

    ``idempotency_key``: the key sent; ``operation_id``: the operation that holds it."""

    @property
    def idempotency_key(self) -> str | None:
        return _text(self.body.get("idempotency_key"))

    @property
    def operation_id(self) -> str | None:
        return _text(self.body.get("operation_id"))


class RunConflict(Conflict):
    """409: the run key was already used for a run with different steps or budget (``run_id``: that run)."""

    @property
    def run_id(self) -> str | None:
        return _text(self.body.get("run_id"))


class Refused(Conflict):
    """409: a rule of the actions file refused the intent at submit (nothing stored): ``outcome`` is
    ``REFUSED``, ``detail`` the sentence a model reads."""

    @property
    def outcome(self) -> str | None:
        return _text(self.body.get("outcome"))


class BudgetExhausted(Refused):
    """409: the conversation's budget (``budget_scope``) has no room; ``budget``: what is left of each."""

    @property
    def budget(self) -> dict[str, Any]:
        found = self.body.get("budget")
        return found if isinstance(found, dict) else {}


class ObjectBusy(Refused):
    """409: the business object is held by an operation whose outcome is not known (``waiting_on``)."""

    @property
    def waiting_on(self) -> dict[str, Any]:
        found = self.body.get("waiting_on")
        return found if isinstance(found, dict) else {}


class SubjectStopped(Refused):
    """409: an operator stopped the intent's subject (``stopped``: who, when, why); nothing stored."""

    @property
    def stopped(self) -> dict[str, Any]:
        found = self.body.get("stopped")
        return found if isinstance(found, dict) else {}


class RateLimited(OutboxProblem):
    """429: this key's rate is used up; ``retry_after_s`` says when to come back."""


class Unavailable(OutboxProblem):
    """503 (or a gateway's 502/504): the server or something in front of it cannot answer now."""


class NotConfigured(OutboxProblem):
    """503 that waiting will not mend: the server lacks its actions file, or an extra is not installed."""


class OutboxUnreachable(OutboxError):
    """The request failed on the way (``reached_server`` False: it never left, e.g. connection refused),
    or its answer was lost (``reached_server`` True: a timeout or a dropped connection after sending).

    A submit that ends here may have been stored: submit it again with the SAME ``idempotency_key``
    (it answers the stored operation), never with a new one."""

    def __init__(self, method: str, url: str, *, reached_server: bool, idempotency_key: str | None = None) -> None:
        what = "its answer was lost" if reached_server else "it was not sent"
        super().__init__(f"{method} {url}: {what}")
        self.method, self.url, self.reached_server, self.idempotency_key = method, url, reached_server, idempotency_key


_BY_KIND: dict[str, type[OutboxProblem]] = {
    "invalid": InvalidInput,
    "malformed-body": MalformedBody,
    "too-large": TooLarge,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "separation-of-duties": SeparationOfDuties,
    "not-found": NotFound,
    "conflict": Conflict,
    "local-breakers": Conflict,
    "idempotency-conflict": IdempotencyConflict,
    "run-conflict": RunConflict,
    "refused": Refused,
    "budget-exhausted": BudgetExhausted,
    "object-busy": ObjectBusy,
    "subject-stopped": SubjectStopped,
    "rate-limited": RateLimited,
    "not-configured": NotConfigured,
    "not-installed": NotConfigured,
}
_BY_STATUS: dict[int, type[OutboxProblem]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: InvalidInput,
    429: RateLimited,
    502: Unavailable,
    503: Unavailable,
    504: Unavailable,
}


def problem_of(response: httpx.Response, *, retry_after_s: float | None = None) -> OutboxProblem:
    """The typed exception for an error answer (not raised: the caller decides)."""
    body = _problem_body(response)
    said = body.get("status")
    status = said if isinstance(said, int) and not isinstance(said, bool) else response.status_code
    said = body.get("type")
    type_ = said if isinstance(said, str) else "about:blank"
    title = _text(body.get("title")) or response.reason_phrase or "Error"
    cls = _BY_KIND.get(type_.removeprefix(PROBLEM_BASE)) if type_.startswith(PROBLEM_BASE) else None
    cls = cls or _BY_STATUS.get(response.status_code, OutboxProblem)
    return cls(
        type=type_,
        title=title,
        status=status,
        detail=_text(body.get("detail")) or title,
        field=_text(body.get("field")),
        body=body,
        retry_after_s=retry_after_s,
    )


def invalid(field: str, detail: str) -> InvalidInput:
    """Refused before sending, as the server refuses it (the same type, status and field)."""
    kind, title = PROBLEM_BASE + "invalid", "Invalid input"
    body = {"type": kind, "title": title, "status": 422, "detail": detail, "field": field}
    return InvalidInput(type=kind, title=title, status=422, detail=detail, field=field, body=body)


def _problem_body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = json.loads(response.content, parse_float=Decimal)
    except ValueError:  # not JSON (a proxy's page): its first words are the detail
        text = response.content[:300].decode("utf-8", "replace").strip()
        return {"detail": text} if text else {}
    return body if isinstance(body, dict) else {}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
