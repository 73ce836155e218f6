"""mypy --strict on our packages (STYLE.md); the configuration is [tool.mypy] in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_our_packages_type_check_strictly() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
