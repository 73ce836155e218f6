"""Workers: the Celery app, relay, dispatch, reconcile (``celery -A workers worker``).

The Celery app is built on first access of ``workers.app`` (so importing ``workers.provider.classify`` or
``workers.provider.actions`` does not read broker settings).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("app", "celery"):
        from workers.wiring.tasks import app

        return app
    raise AttributeError(name)
