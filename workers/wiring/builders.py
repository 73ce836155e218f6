"""What a process builds from its Settings and the actions file: the actions file itself, the
breaker registry, the pacer, and every reason a worker would refuse to start. The workers' runtime
(runtime.py) and the service layer (workers/service/) both build from here.
"""

from __future__ import annotations

from breaker import BreakerConfig, BreakerRegistry
from outbox.errors import ConfigError
from outbox.privacy.retention import check_retention
from outbox.settings import Settings
from workers.pacing import Pacer, limits_of
from workers.provider.actions import ActionsFile, load_actions
from workers.wiring.celery_app import check_time_limits


def longest_call_s(actions: ActionsFile) -> float:
    return max((t.timeout_s + t.connect_timeout_s for t in actions.targets.values()), default=0.0)


def check_approval_windows(settings: Settings, actions: ActionsFile) -> None:
    """The actions file checked approvals against the default reconcile window; this deployment's
    own (OUTBOX_RECONCILE_MAX_LOOKUPS x OUTBOX_RECONCILE_MAX_DELAY_S) must fit too."""
    window = settings.reconcile_max_lookups * settings.reconcile_max_delay_s
    for name, action in actions.actions.items():
        problem = action.approval_window_problem(window)
        if problem:
            raise ConfigError(
                f"actions.{name}: {problem} (the reconcile window is this deployment's "
                "OUTBOX_RECONCILE_MAX_LOOKUPS x OUTBOX_RECONCILE_MAX_DELAY_S)"
            )


def start_up_problems(settings: Settings, actions: ActionsFile) -> list[str]:
    """Every reason a worker would refuse to start with this actions file under these settings
    (``agent-outbox actions check`` reports them too)."""

    def time_limits() -> None:
        check_time_limits(settings, longest_call_s=longest_call_s(actions))

    def retention() -> None:
        check_retention(settings.args_retention_s, actions.key_retentions())

    def approval_windows() -> None:
        check_approval_windows(settings, actions)

    problems = []
    for check in (time_limits, retention, approval_windows):
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def load_actions_for(settings: Settings) -> ActionsFile:
    if settings.actions_file is None:
        raise ConfigError(
            "OUTBOX_ACTIONS_FILE is not set: workers need the actions/targets file (see examples/actions.yaml)"
        )
    return load_actions(settings.actions_file)


def breaker_registry(settings: Settings, actions: ActionsFile) -> BreakerRegistry:
    configs = {
        name: BreakerConfig(
            fail_max=t.breaker.fail_max,
            reset_timeout_s=t.breaker.reset_timeout_s,
            success_threshold=t.breaker.success_threshold,
        )
        for name, t in actions.targets.items()
    }
    # The broker key prefix doubles as the breaker namespace: one Redis, several deployments.
    return BreakerRegistry(
        configs, redis_url=settings.redis_url or None, namespace=settings.broker_key_prefix or "default"
    )


def pacer_for(settings: Settings, actions: ActionsFile, process_id: str) -> Pacer:
    """The process's limits: shared through OUTBOX_REDIS_URL under the deployment's namespace (the
    breakers'), or this process's own without it."""
    return Pacer(
        limits_of(actions),
        process_id=process_id,
        redis_url=settings.redis_url or None,
        namespace=settings.broker_key_prefix or "default",
        fallback_processes=settings.pacing_fallback_processes,
    )
