"""The example's settings as an application without time zone support has them: Django then reads
timestamps as naive local times (and sets the session's TimeZone to TIME_ZONE), which the ledger
must not see (tests/integration/agents/test_django.py)."""

from refunds_site.settings import *  # noqa: F403

USE_TZ = False
TIME_ZONE = "America/Chicago"
