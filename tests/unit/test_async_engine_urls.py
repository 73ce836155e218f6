"""An asyncpg-only application (extra [asyncpg], no psycopg implementation) can open the ledger."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
sys.modules["psycopg"] = None  # as on a machine with neither psycopg[binary] nor libpq
from outbox.errors import MissingDependency
from outbox.ledger.db import make_async_engine
engine = make_async_engine("postgresql+asyncpg://outbox@127.0.0.1:1/outbox")  # nothing connects
print(engine.dialect.driver)
try:
    make_async_engine("postgresql+psycopg://outbox@127.0.0.1:1/outbox")
except MissingDependency as exc:
    print("refused:", str(exc).split(";")[0])
"""


def test_an_asyncpg_url_needs_no_psycopg_and_a_psycopg_url_says_what_to_install():
    """make_async_engine asked for a psycopg implementation even for postgresql+asyncpg://, which
    docs/how-to/submit.md says the [asyncpg] extra is enough for."""
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "asyncpg"
    assert lines[1].startswith("refused: a PostgreSQL ledger needs a psycopg implementation"), lines
