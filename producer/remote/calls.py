"""Each request the client makes, as a value: method, path, query, body, whether it may be sent
again, and how its answer is read. The sync and async clients send the same calls; only the I/O
differs.

``replay_safe``: sending the request twice does what sending it once does. Reads are; a submit is,
because it carries its idempotency key (a second submit answers the stored operation); a decision
(cancel, approve, deny, resolve) is not: its answer to a repeat differs (a 409 "moved on"), so it is
repeated only when the first provably did not reach the server (retries.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from outbox.errors import InvalidIntent
from outbox.ledger.envelope import canonical_value
from producer.remote.models import Approval, BatchItem, Handoff, Operation, Page, PendingApproval, Run
from producer.remote.problems import invalid

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[httpx.Response], T]
    params: dict[str, Any] | None = None
    body: Any = None  # None: no body
    replay_safe: bool = True
    wait_s: float = 0.0  # the server holds the request this long (a long-poll) before it answers
    idempotency_key: str | None = None  # said again by OutboxUnreachable: the key to submit again with
    headers: Mapping[str, str] | None = None  # this request's own (the client's are sent with every one)

    def content(self) -> bytes | None:
        return None if self.body is None else dumps(self.body).encode()


def dumps(value: Any) -> str:
    """JSON with Decimals written as the exact numbers they are (the server reads every number as a
    Decimal); a tuple is an array."""
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        return str(value)  # 12.50 stays 12.50, 1E+2 is a JSON number as it is
    if isinstance(value, Mapping):
        return "{" + ",".join(json.dumps(str(k)) + ":" + dumps(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value, allow_nan=False)


def loads(response: httpx.Response) -> Any:
    return json.loads(response.content, parse_float=Decimal)


def _checked_args(args: Any, path: str) -> Any:
    """The ledger's own check of arguments, before anything is sent: a binary float (0.1 is not the
    decimal meant), NaN, a non-JSON value are refused naming the field, as ``producer.submit`` does."""
    try:
        canonical_value(args, path)
    except InvalidIntent as exc:
        raise invalid(exc.field, exc.reason) from None
    return args


def _segment(value: str | int) -> str:
    return quote(str(value), safe="")


def _operation(response: httpx.Response) -> Operation:
    return Operation.model_validate(loads(response))


def _submitted(response: httpx.Response) -> Operation:
    op = _operation(response)
    op._new = response.status_code == 201
    return op


def _run(response: httpx.Response) -> Run:
    return Run.model_validate(loads(response))


def _submitted_run(response: httpx.Response) -> Run:
    run = _run(response)
    run._new = response.status_code == 201
    return run


def _handoff(response: httpx.Response) -> Handoff:
    return Handoff.model_validate(loads(response))


def _approval(response: httpx.Response) -> Approval:
    return Approval.model_validate(loads(response))


def intent_body(
    action: str,
    args: Mapping[str, Any],
    idempotency_key: str,
    *,
    subject: str | None = None,
    run_id: str | None = None,
    tool_call_id: str | None = None,
    max_attempts: int | None = None,
    deadline_s: float | None = None,
    priority: int | None = None,
    where: str = "args",
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "action": action,
        "idempotency_key": idempotency_key,
        "args": _checked_args(dict(args) if isinstance(args, Mapping) else args, where),
    }
    optional = {
        "subject": subject,
        "run_id": run_id,
        "tool_call_id": tool_call_id,
        "max_attempts": max_attempts,
        "deadline_s": deadline_s,
        "priority": priority,
    }
    return body | {k: v for k, v in optional.items() if v is not None}


def submit(body: dict[str, Any], budget_scope: str | None = None) -> Call[Operation]:
    """``budget_scope``: the conversation charged for it (the ``Outbox-Budget-Scope`` header; the
    actions file's ``budget_scope`` decides what it may spend)."""
    # The key travels in the body, the API's own field: an Idempotency-Key header could not carry
    # every key the ledger accepts (HTTP header values are ASCII without surrounding space).
    headers = {"Outbox-Budget-Scope": budget_scope} if budget_scope is not None else None
    return Call("POST", "/v1/intents", _submitted, body=body, idempotency_key=body["idempotency_key"], headers=headers)


def batch_bodies(intents: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each intent as given (the server answers each on its own), its arguments checked as submit's are."""
    out = []
    for i, intent in enumerate(intents):
        item = dict(intent)
        if "args" in item:
            item["args"] = _checked_args(item["args"], f"intents.{i}.args")
        out.append(item)
    return out


def submit_batch(bodies: Sequence[dict[str, Any]]) -> Call[list[BatchItem]]:
    def read(response: httpx.Response) -> list[BatchItem]:
        return [BatchItem.model_validate(item) for item in loads(response)["results"]]

    return Call("POST", "/v1/intents:batch", read, body={"intents": list(bodies)})


def get(operation_id: str) -> Call[Operation]:
    return Call("GET", f"/v1/operations/{_segment(operation_id)}", _operation)


def wait(operation_id: str, timeout_s: float) -> Call[Operation]:
    path = f"/v1/operations/{_segment(operation_id)}/wait"
    return Call("GET", path, _operation, params={"timeout_s": timeout_s}, wait_s=timeout_s)


def cancel(operation_id: str) -> Call[Operation]:
    return Call("POST", f"/v1/operations/{_segment(operation_id)}/cancel", _operation, replay_safe=False)


def operations(
    *,
    status: str | None = None,
    action: str | None = None,
    idempotency_key: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> Call[Page]:
    query = {"status": status, "action": action, "idempotency_key": idempotency_key, "limit": limit, "cursor": cursor}
    return Call(
        "GET",
        "/v1/operations",
        lambda r: Page.model_validate(loads(r)),
        params={k: v for k, v in query.items() if v is not None},
    )


def submit_run(
    run_key: str,
    steps: Sequence[Mapping[str, Any]],
    *,
    budget: Mapping[str, Any] | None = None,
    subject: str | None = None,
    priority: int | None = None,
) -> Call[Run]:
    checked = []
    for i, step in enumerate(steps):
        step = dict(step)
        if "args" in step:
            step["args"] = _checked_args(step["args"], f"steps.{i}.args")
        if isinstance(step.get("compensate"), Mapping) and "args" in step["compensate"]:
            comp = dict(step["compensate"])
            comp["args"] = _checked_args(comp["args"], f"steps.{i}.compensate.args")
            step["compensate"] = comp
        checked.append(step)
    body: dict[str, Any] = {"run_key": run_key, "steps": checked}
    if budget is not None:
        body["budget"] = dict(budget)
    if subject is not None:
        body["subject"] = subject
    if priority is not None:
        body["priority"] = priority
    # The run key is the run's idempotency key: the same run again answers the stored one.
    return Call("POST", "/v1/runs", _submitted_run, body=body, idempotency_key=run_key)


def get_run(run_id: str) -> Call[Run]:
    return Call("GET", f"/v1/runs/{_segment(run_id)}", _run)


def cancel_run(run_id: str, *, compensate: bool = False) -> Call[Run]:
    path = f"/v1/runs/{_segment(run_id)}/cancel"
    return Call("POST", path, _run, body={"compensate": compensate}, replay_safe=False)


def approvals() -> Call[list[PendingApproval]]:
    def read(response: httpx.Response) -> list[PendingApproval]:
        return [PendingApproval.model_validate(a) for a in loads(response)["approvals"]]

    return Call("GET", "/v1/approvals", read)


def decide(operation_id: str, *, approve: bool, by: str, note: str | None) -> Call[Approval]:
    verb = "approve" if approve else "deny"
    body = {"by": by} | ({"note": note} if note is not None else {})
    return Call("POST", f"/v1/approvals/{_segment(operation_id)}/{verb}", _approval, body=body, replay_safe=False)


def handoffs(*, include_resolved: bool = False) -> Call[list[Handoff]]:
    def read(response: httpx.Response) -> list[Handoff]:
        return [Handoff.model_validate(h) for h in loads(response)["handoffs"]]

    return Call("GET", "/v1/handoffs", read, params={"all": "true"} if include_resolved else None)


def handoff(handoff_id: int) -> Call[Handoff]:
    return Call("GET", f"/v1/handoffs/{_segment(handoff_id)}", _handoff)


def resolve_handoff(
    handoff_id: int, *, resolution: str, note: str, by: str, reference: str | None = None
) -> Call[Handoff]:
    body = {"as": resolution, "note": note, "by": by} | ({"reference": reference} if reference is not None else {})
    return Call("POST", f"/v1/handoffs/{_segment(handoff_id)}/resolve", _handoff, body=body, replay_safe=False)
