"""What the CLI (and later the console) calls to read and reset breakers.

Both functions accept a live ``BreakerRegistry`` (in-process, e.g. the embedded default) or a
Redis URL (a separate CLI process reading the workers' shared state). A reset through Redis
takes effect in every worker on its next ``before_call``: workers keep no cached state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from breaker.errors import BreakerStorageUnavailable
from breaker.registry import BreakerRegistry, connect
from breaker.state import BreakerStatus, from_ms
from breaker.storage import RedisBreakerStorage

log = logging.getLogger(__name__)


def status(source: BreakerRegistry | str, targets: Sequence[str], namespace: str = "default") -> list[BreakerStatus]:
    """One row per target. Through a URL, a target never seen is closed with 0 failures.

    Raises BreakerStorageUnavailable if Redis cannot be read through a URL: the CLI has
    no local state to show instead.
    """
    if isinstance(source, BreakerRegistry):
        return source.status(targets)
    client = connect(source)
    try:
        rows = []
        for target in targets:
            snap = RedisBreakerStorage(client, namespace, target).snapshot()
            rows.append(
                BreakerStatus(
                    target, snap.state, snap.failures, from_ms(snap.opened_at_ms), from_ms(snap.reopens_at_ms), "redis"
                )
            )
        return rows
    except RedisError as exc:
        raise BreakerStorageUnavailable(source, repr(exc)) from exc
    finally:
        client.close()


def reset(source: BreakerRegistry | str, target: str, *, by: str, namespace: str = "default") -> None:
    """Close ``target``'s breaker now, everywhere; logged at WARNING with who and when."""
    if isinstance(source, BreakerRegistry):
        source.reset(target, by)
        return
    client = connect(source)
    try:
        previous = RedisBreakerStorage(client, namespace, target).reset(by, None)
    except RedisError as exc:
        raise BreakerStorageUnavailable(source, repr(exc)) from exc
    finally:
        client.close()
    log.warning(
        "breaker reset by operator",
        extra={"target": target, "by": by, "previous_state": previous, "namespace": namespace, "reset_at": time.time()},
    )
