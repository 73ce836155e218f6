"""The agent examples run offline, as a newcomer would run them: the embedded ledger, the sandbox, a
scripted model; no PostgreSQL, Redis or network. Each ends with one refund at the provider."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples" / "agents"


@pytest.mark.parametrize(
    ("script", "needs"),
    [
        ("mcp_client.py", "mcp"),
        ("openai_agents_refund.py", "agents"),
        ("langgraph_approval.py", "langgraph.checkpoint.sqlite"),
    ],
)
def test_the_example_runs_offline_and_makes_one_refund(script, needs, tmp_path):
    pytest.importorskip(needs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")} | {"HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [line for line in done.stdout.splitlines() if line.startswith("refunds the provider made:")]
    assert counts and all(line.endswith(": 1") for line in counts), done.stdout
    assert "Already done" in done.stdout
