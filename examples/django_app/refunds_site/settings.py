"""The example's settings: one database for the application's rows and the outbox's tables.

OUTBOX_DATABASE_URL names it (``postgresql+psycopg://user:password@host:5432/name``), as it does for
``agent-outbox migrate``, the relay and the workers; Django's ``DATABASES`` is read from it.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = ["refunds"]
MIDDLEWARE: list[str] = []  # a JSON API for the example: no sessions, no CSRF cookie
ROOT_URLCONF = "refunds_site.urls"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def database_from_url(url: str) -> dict[str, object]:
    """``postgresql[+driver]://user:password@host:port/name`` (or ``sqlite:///path``) as a DATABASES entry."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+")[0]
    if scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parts.path.removeprefix("/"))}
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(f"OUTBOX_DATABASE_URL: unsupported database {scheme!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.removeprefix("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


DATABASES = {"default": database_from_url(os.environ["OUTBOX_DATABASE_URL"])}

# What the outbox's producer needs of the application: the tenant it submits for, and the actions
# file (provider keys and approval rules are decided at submit; the targets' secrets are not read).
OUTBOX_TENANT = os.environ.get("OUTBOX_DEFAULT_TENANT", "acme")
OUTBOX_ACTIONS_FILE = os.environ.get("OUTBOX_ACTIONS_FILE")
