"""Each action's approval policy, as the workers' actions file declares it (the policy an approval
is given under; outbox/service/approvals.py takes them as a mapping)."""

from __future__ import annotations

from outbox.approvals.decisions import ApprovalPolicy
from outbox.settings import Settings
from workers.wiring.builders import load_actions_for


def approval_policies(settings: Settings) -> dict[str, ApprovalPolicy]:
    """Raises ConfigError when OUTBOX_ACTIONS_FILE is not set: there is no policy to approve under."""
    return {name: action.approval for name, action in load_actions_for(settings).actions.items()}
