"""Breaker commands: ``breaker status`` and ``breaker reset TARGET``.

Both read OUTBOX_ACTIONS_FILE (the targets) and OUTBOX_REDIS_URL (the shared breaker state), with
the namespace the workers use (``workers.wiring.runtime.breaker_registry``: OUTBOX_BROKER_KEY_PREFIX or
"default"). Without OUTBOX_REDIS_URL every worker keeps its breakers in its own memory: this
process cannot see them, so ``status`` says so instead of showing a made-up "closed", and
``reset`` refuses (it could not reach them).

A reset closes the breaker in Redis (every worker sees it on its next call) and makes due now
the operations the breaker had parked until its reopen time, so they do not sit out a reset
timeout the operator just cancelled. Both are recorded with who and when: the breaker's hash
(reset_by, reset_at_ms), a WARNING log line, and one ledger event per released operation.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from datetime import datetime
from typing import Any

from breaker import BreakerRegistry, BreakerStatus
from breaker import reset as reset_breaker
from breaker import status as breaker_status
from breaker.errors import BreakerStorageUnavailable
from outbox.ledger.db import make_sessionmaker
from outbox.ledger.waits import wake_breaker_waits
from outbox.settings import Settings, load_settings
from workers.cli.ledger import open_engine
from workers.provider.actions import ActionsConfig
from workers.wiring.runtime import breaker_registry, load_actions_for

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2

LOCAL_NOTE = (
    "breakers are process-local: OUTBOX_REDIS_URL is not set, so each worker keeps its breakers "
    "in its own memory and this command cannot see (or reset) them; set OUTBOX_REDIS_URL to share them"
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("breaker", help="read and reset the circuit breakers of the targets")
    b_sub = p.add_subparsers(dest="breaker_command", metavar="SUBCOMMAND")
    s = b_sub.add_parser("status", help="every target of the actions file: state, failures, opened at, reopens at")
    s.add_argument("--json", action="store_true", help="one JSON document")
    s.set_defaults(func=cmd_status)
    r = b_sub.add_parser("reset", help="close a target's breaker now, in every worker")
    r.add_argument("target", metavar="TARGET")
    r.add_argument("--by", help="who resets (default: the current user)")
    r.set_defaults(func=cmd_reset)
    p.set_defaults(func=lambda args: (p.print_help(), EXIT_INVALID)[1])


def _load() -> tuple[Settings, ActionsConfig, BreakerRegistry]:
    settings = load_settings()
    actions = load_actions_for(settings)
    return settings, actions, breaker_registry(settings, actions)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _row(registry: BreakerRegistry, st: BreakerStatus | None, target: str) -> dict[str, Any]:
    config = registry.configs[target]
    return {
        "target": target,
        "state": st.state if st else None,
        "failures": st.failures if st else None,
        "fail_max": config.fail_max,
        "reset_timeout_s": config.reset_timeout_s,
        "opened_at": _iso(st.opened_at) if st else None,
        "reopens_at": _iso(st.reopens_at) if st else None,
    }


def cmd_status(args: argparse.Namespace) -> int:
    settings, _, registry = _load()
    targets = sorted(registry.configs)
    doc: dict[str, Any] = {"namespace": registry.namespace, "shared": bool(registry.redis_url)}
    try:
        if not registry.redis_url:
            doc |= {
                "storage": "process-local",
                "note": LOCAL_NOTE,
                "breakers": [_row(registry, None, t) for t in targets],
            }
        else:
            rows = breaker_status(registry.redis_url, targets, registry.namespace)
            doc |= {"storage": "redis", "breakers": [_row(registry, st, st.target) for st in rows]}
    except BreakerStorageUnavailable as exc:
        print(f"agent-outbox: {exc}; check OUTBOX_REDIS_URL", file=sys.stderr)
        return EXIT_FAILED
    finally:
        registry.close()
    if args.json:
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    if not doc["shared"]:
        print(LOCAL_NOTE)
        print("targets: " + ", ".join(targets))
        return EXIT_OK
    header = ("TARGET", "STATE", "FAILURES", "OPENED AT", "REOPENS AT")
    lines = [header] + [
        (r["target"], r["state"], f"{r['failures']}/{r['fail_max']}", r["opened_at"] or "-", r["reopens_at"] or "-")
        for r in doc["breakers"]
    ]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())
    return EXIT_OK


def cmd_reset(args: argparse.Namespace) -> int:
    settings, actions, registry = _load()
    registry.close()
    target = args.target
    if target not in registry.configs:
        known = ", ".join(sorted(registry.configs)) or "(none)"
        print(f"agent-outbox: unknown target {target!r}; known targets: {known}", file=sys.stderr)
        return EXIT_INVALID
    if not registry.redis_url:
        print(f"agent-outbox: cannot reset: {LOCAL_NOTE}", file=sys.stderr)
        return EXIT_INVALID
    by = args.by or os.environ.get("USER") or getpass.getuser()
    try:
        reset_breaker(registry.redis_url, target, by=by, namespace=registry.namespace)
    except BreakerStorageUnavailable as exc:
        print(f"agent-outbox: breaker not reset: {exc}; check OUTBOX_REDIS_URL", file=sys.stderr)
        return EXIT_FAILED
    print(f"breaker {target} closed by {by} at {datetime.now().astimezone().isoformat(timespec='seconds')}")
    names = sorted(name for name, a in actions.actions.items() if a.target == target)
    try:
        woken = wake_parked(settings, names, target=target, by=by)
    except Exception as exc:  # noqa: BLE001 - the reset itself is done; say what was not
        print(
            f"agent-outbox: the breaker is closed, but parked operations could not be made due ({exc}); "
            "they run at their reopen time",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"{woken} parked operation(s) due now")
    return EXIT_OK


def wake_parked(settings: Settings, action_names: list[str], *, target: str, by: str) -> int:
    """not_dispatched operations of these actions waiting for the breaker -> due now.

    Only rows the breaker parked (waiting_for = breaker) and that are not yet due: a retry
    scheduled by backoff or Retry-After keeps its time. One event per row records who.
    """
    if not action_names:
        return 0
    engine = open_engine(settings)
    why = f"breaker for {target} reset by {by}"
    try:
        with make_sessionmaker(engine).begin() as session:
            woken = wake_breaker_waits(session, action_names, reason=why, actor=by)
    finally:
        engine.dispose()
    return len(woken)
