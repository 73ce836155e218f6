"""The handoff packet: everything a person needs to settle an operation (DESIGN.md, five items)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from outbox.evidence.late_successes import PacketBuilder
from outbox.ledger.models import Approval, Attempt, Operation
from outbox.ledger.states import AttemptClass, AttemptKind, WaitingFor
from outbox.privacy.masking import MASK, masked_view
from outbox.privacy.retention import PURGED
from outbox.reads.queries import approval_json, attempt_json, provider_key_of
from workers.provider.actions import ActionConfig, ActionsFile


def masked_args(args_text: str | None, action: ActionConfig | None) -> Any:
    """The arguments with the action's sensitive paths masked; the action unknown here (so is what
    it marks sensitive): every value masked. Purged arguments (agent-outbox purge) are None."""
    if args_text is None:
        return None
    args = json.loads(args_text)
    if action is not None:
        return action.masked_args(args)
    return {k: MASK for k in args} if isinstance(args, dict) else MASK


def next_step(
    op: Operation, action: ActionConfig | None, actions: ActionsFile | None, attempts: Sequence[Attempt] = ()
) -> str:
    """What the person should do: by what the operation waits for (the provider refused our
    credentials; a final failure the action hands over), else find out whether the effect exists."""
    if op.waiting_for == WaitingFor.CREDENTIALS.value:
        return credentials_step(op, action, actions, attempts)
    if op.waiting_for == WaitingFor.DECISION.value:
        return decision_step(op)
    if op.waiting_for == WaitingFor.AUTHORITY.value:
        return authority_step(op)
    return look_up_step(op, action, actions)


def authority_step(op: Operation) -> str:
    return (
        f"The API key that submitted it ({op.submitted_by}) was revoked (why_handed_off says when), and nothing "
        "was sent since: automation sends nothing more in its name. If it must still happen, decide it in your own "
        "name: agent-outbox handoffs resolve ID --as not-executed --by NAME --note TEXT sends it under the same key "
        f"({provider_key_of(op)!r}) with the same arguments. Otherwise --as abandoned with a note, and tell whoever "
        "asked: the agent must submit again with a valid key."
    )


def credentials_step(
    op: Operation, action: ActionConfig | None, actions: ActionsFile | None, attempts: Sequence[Attempt]
) -> str:
    target = action.target if action is not None else "its target"
    cfg = actions.targets.get(action.target) if action is not None and actions is not None else None
    where = f"targets.{target}.headers"
    if cfg is not None and cfg.accounts:
        where = f"targets.{target}.tenants.{op.tenant}.headers"
    at = f" ({cfg.base_url})" if cfg is not None else ""
    sent = [a for a in attempts if a.kind == AttemptKind.DISPATCH.value]
    status = next((a.status_code for a in reversed(sent) if a.status_code is not None), None)
    first = ""
    if any(a.attempt_class in _IN_DOUBT and a.attempt_number > (op.proven_absent_through or 0) for a in sent):
        first = f"First, an earlier attempt may have taken effect: {look_up_step(op, action, actions)} Then: "
    return (
        f"{first}The provider{at} refused our credentials (HTTP {status or '401/403'}): nothing was executed. Check "
        f"the credentials this operation was sent with ({where} in the actions file, and the secrets it names, "
        f"for tenant {op.tenant}): revoked, expired, or without the permission this action needs. Rotate or "
        f"grant them and restart the workers; then agent-outbox handoffs resolve ID --as not-executed --by NAME "
        f"--note TEXT sends it again under the same key ({provider_key_of(op)!r}). If it must not go ahead: "
        f"--as abandoned with a note."
    )


# Dispatch attempts that may have taken effect, unless a later proof (proven_absent_through) says not.
_IN_DOUBT = (AttemptClass.AMBIGUOUS.value, AttemptClass.PENDING.value)


def decision_step(op: Operation) -> str:
    return (
        "It would have ended failed_before_commit (why_handed_off says why), and nothing was executed at the "
        "provider; its action hands such an end to a person (on_final_failure: handoff). If what stopped it can "
        "be fixed outside this intent (an account limit, a missing record, credentials), fix it and run "
        "agent-outbox handoffs resolve ID --as not-executed --by NAME --note TEXT: it is sent again under the "
        f"same key ({provider_key_of(op)!r}) with the same arguments. Otherwise --as abandoned with a note, and "
        "tell whoever asked: a changed intent needs a new idempotency key."
    )


def look_up_step(op: Operation, action: ActionConfig | None, actions: ActionsFile | None) -> str:
    where = "the provider's dashboard or API"
    if action is not None and actions is not None:
        target = actions.targets.get(action.target)
        base = target.base_url if target else action.target
        if action.lookup is not None:
            req = action.lookup.request
            query = "&".join(f"{k}={v}" for k, v in (req.query or {}).items()).replace(
                "{idempotency_key}", provider_key_of(op)
            )
            where = f"{req.method} {base}{req.path}" + (f"?{query}" if query else "")
        else:
            where = f"{base} (this action declares no lookup)"
    return (
        f"Look for idempotency key {provider_key_of(op)!r} (tenant {op.tenant}) at {where}. "
        f"If the effect exists: agent-outbox handoffs resolve ID --as succeeded --reference <provider id> "
        f"--by NAME --note TEXT. If the provider confirms it never happened: --as not-executed (re-dispatched "
        f"with the same key). If neither can be established: --as abandoned with a note."
    )


def build_packet(
    session: Session,
    op: Operation,
    *,
    reason: str,
    action: ActionConfig | None,
    actions: ActionsFile | None,
    candidates: Sequence[str] = (),
) -> dict[str, Any]:
    """``candidates``: the references of objects at the provider that each pass the lookup's
    ``match:`` (an ambiguous lookup); the person says which one, if any, is ours."""
    attempts = list(
        session.execute(select(Attempt).where(Attempt.operation_id == op.id).order_by(Attempt.id)).scalars()
    )
    step = next_step(op, action, actions, attempts)
    if candidates:
        step = (
            f"The lookup found {len(candidates)} objects that match this intent: {', '.join(candidates)}. "
            "If one of them is this operation's effect, resolve --as succeeded --reference <that one>. " + step
        )
    packet = {
        "operation": {
            "operation_id": op.id,
            "idempotency_key": op.idempotency_key,
            "provider_key": provider_key_of(op),
            "tenant": op.tenant,
            "action": op.action,
            "target": action.target if action else None,
        },
        "attempts": [attempt_json(a) for a in attempts],
        "last_error": {"class": op.error_class, "raw": op.last_error, "why_handed_off": reason},
        "next_step": step,
        "request": request_view(op, action, actions),
        "intent": {
            "args": masked_args(op.args, action),
            "args_digest": op.args_digest,
            "subject": op.subject,
            "run_id": op.run_id,
            "tool_call_id": op.tool_call_id,
            "approval": _approval(session, op.id),
        },
    }
    if candidates:
        packet["candidates"] = list(candidates)
    return packet


def request_view(op: Operation, action: ActionConfig | None, actions: ActionsFile | None) -> dict[str, Any]:
    """The action's versions (at submit, of the first request that left, now) and that request
    (outbox/ledger/request_record.py): its path and body masked as the arguments are (the action
    unknown here: masked whole), "purged" once retention took them."""
    sent = None
    if op.request_version is not None or op.request_digest is not None:
        path, body = op.request_path, op.request_body
        if op.args is None:  # purged with the arguments they were built from
            path, body = PURGED, PURGED
        elif action is None:
            path, body = MASK if path else path, MASK if body else body
        else:
            redactor = action.redactor(json.loads(op.args))
            path = redactor.text(path)
            if body:
                body = json.dumps(masked_view(json.loads(body), action.sensitive_args, redactor), ensure_ascii=False)
        sent = {
            "version": op.request_version,
            "method": op.request_method,
            "path": path,
            "body": body,
            "digest": op.request_digest,
        }
    return {
        "action_version": op.action_version,
        "current_version": actions.action_version(op.action) if actions is not None else None,
        "sent": sent,
    }


def _approval(session: Session, operation_id: str) -> dict[str, Any] | None:
    """The latest decision on the operation's approval (who, when, policy version, expiry)."""
    last = session.execute(
        select(Approval).where(Approval.operation_id == operation_id).order_by(Approval.id.desc()).limit(1)
    ).scalar_one_or_none()
    return approval_json(last) if last is not None else None


def packet_builder(actions: ActionsFile | None) -> PacketBuilder:
    """build_packet for whatever operation comes up (late evidence), its action looked up in
    ``actions``; without an actions file every argument is masked."""

    def build(session: Session, op: Operation, reason: str) -> dict[str, Any]:
        action = actions.actions.get(op.action) if actions is not None else None
        return build_packet(session, op, reason=reason, action=action, actions=actions)

    return build
