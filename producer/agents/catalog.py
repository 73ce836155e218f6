"""Each action of the actions file as a tool: name, description, input schema, what its key is made
of, and whether a person approves it first (outbox.actions.rules: no target secrets needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.actions.rules import ActionRules
from outbox.actions.specs import ApprovalSpec
from outbox.errors import InvalidIntent

# The one argument every tool has that is not the action's: after a final "did not happen" whose
# cause was fixed, the model names the failed call's operation to try again (producer/agents/calls.py).
RETRY_OF = "retry_of"
RETRY_OF_SCHEMA: dict[str, Any] = {
    "type": "string",
    "description": (
        "Only to try again after this tool answered FAILED_BEFORE_COMMIT or FAILED_AT_PROVIDER for the same "
        "call and the cause was fixed: that answer's operation_id. Leave it out otherwise."
    ),
}
# The other: a second call on purpose. The same arguments twice are one call (one effect); a model that
# means another one (a second partial refund of one order) says which with a small number or a label of
# its own, part of the call's key (producer/agents/calls.py occurrence_of). Absent (or 1): the first one.
OCCURRENCE = "occurrence"
MAX_OCCURRENCE = 1000
OCCURRENCE_LABEL = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
OCCURRENCE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "integer", "minimum": 1, "maximum": MAX_OCCURRENCE},
        {"type": "string", "pattern": OCCURRENCE_LABEL},
    ],
    "description": (
        "Pass it only to make another one of the same call: the same arguments again are the same call and make no "
        "second effect, so to make a second one on purpose (a second partial refund of one order) pass 2 (then "
        "3, ...) or a short label of your own. Leave it out for the first one. The same occurrence again is "
        "still the same call."
    ),
}
RESERVED = (RETRY_OF, OCCURRENCE)


@dataclass(frozen=True)
class ToolView:
    action: str
    description: str
    input_schema: dict[str, Any]
    reference_args: tuple[str, ...]
    approval: ApprovalSpec
    destructive: bool = True  # tool.destructive of the actions file (MCP's destructiveHint)

    @property
    def may_need_approval(self) -> bool:
        return self.approval.required != "never"

    def needs_approval(self, args: dict[str, Any]) -> bool:
        return self.approval.applies(args)


def _schema(declared: list[str] | None, references: list[str]) -> dict[str, Any]:
    if declared is None:
        return {"type": "object", "properties": {r: {} for r in references}, "required": references}
    return {
        "type": "object",
        "properties": {name: {} for name in declared},
        "required": [r for r in references if r in declared],
        "additionalProperties": False,
    }


def catalog(rules: ActionRules) -> dict[str, ToolView]:
    """Every action of the file, by action name."""
    out: dict[str, ToolView] = {}
    for action in rules.keys:
        spec = rules.tools.get(action)
        declared = rules.declared_args.get(action)
        references = list(spec.reference_args) if spec else []
        description = (spec.description if spec else None) or f"Ask for {action}."
        approval = rules.approvals.get(action) or ApprovalSpec()
        if approval.required != "never":
            description += " A person approves it before anything is sent."
        description += (
            " Each call is idempotent: the same call again returns the same operation and its outcome, never a"
            " second effect. Read `outcome` and `model_message`; never retry an UNKNOWN or PENDING one."
            " `occurrence`: only to make another one of the same call (2, 3, ... or a label); leave it out otherwise."
        )
        schema = dict(spec.args_schema) if spec and spec.args_schema else _schema(declared, references)
        for reserved, use in ((RETRY_OF, "trying a failed tool call again"), (OCCURRENCE, "a second call on purpose")):
            if reserved in (declared or []) or reserved in schema.get("properties", {}):
                raise InvalidIntent(f"actions.{action}.args", f"{reserved!r} is reserved for {use}; rename it")
        schema["properties"] = {
            **schema.get("properties", {}),
            RETRY_OF: RETRY_OF_SCHEMA,
            OCCURRENCE: OCCURRENCE_SCHEMA,
        }
        destructive = spec.destructive if spec else True
        out[action] = ToolView(action, description, schema, tuple(references), approval, destructive)
    return out


def tool_for(tools: dict[str, ToolView], action: str) -> ToolView:
    try:
        return tools[action]
    except KeyError:
        raise InvalidIntent(
            "action", f"unknown action {action!r}; known: {', '.join(sorted(tools)) or '(none)'}"
        ) from None
