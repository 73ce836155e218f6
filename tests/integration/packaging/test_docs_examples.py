"""Every example of the docs site that claims to run is run: a broken example fails the suite.

A page marks such a fenced block with a comment on the line before it:

- ``<!-- run -->`` before a ``sh`` or ``python`` block: run it;
- ``<!-- run: FILE -->`` before any block: write it to FILE (a later block runs or reads it).

The marked blocks of one page run in order as one bash script (a ``python`` block as
``python - <<EOF``), in an empty folder, with this environment's ``agent-outbox`` and ``python`` first
on the PATH and no ``OUTBOX_*`` variable: the embedded default (a SQLite ledger and broker in
``./.outbox/``), as a newcomer runs it. Port 8900, the sandbox provider's port in the docs
(``127.0.0.1:8900`` and ``--port 8900``, no other "8900"), becomes a free port when the page starts
its own sandbox, or else the port of the suite's ``sandbox``. What a page leaves running is stopped
with the page's process group, all but the Celery worker of ``agent-outbox run``: that one has a
process group of its own, and stops on the parent-death signal (workers/cli/pipeline.py) when its
``agent-outbox run`` is killed with the page's group.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"<!-- run(?::\s*(?P<file>\S+))?\s*-->\s*\n```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)\n```", re.S)
# The sandbox's port where the docs name it: an address and the sandbox's flag, not any "8900".
SANDBOX_PORT = re.compile(r"(?<=127\.0\.0\.1:)8900\b|(?<=--port )8900\b")
# The tutorial's workers start, the provider loses an answer and the reconciler settles it by lookup.
TIMEOUT_S = 240


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and BLOCK.search(p.read_text()))


def _script(page: Path) -> str:
    lines = ["set -euo pipefail"]
    for n, block in enumerate(BLOCK.finditer(page.read_text())):
        body, lang, file = block["body"], block["lang"], block["file"]
        mark = f"OUTBOX_DOCS_BLOCK_{n}"
        if file:
            lines += [f"cat > {file} <<'{mark}'", body, mark]
        elif lang in ("sh", "bash", "shell"):
            lines.append(body)
        elif lang == "python":
            lines += [f"python - <<'{mark}'", body, mark]
        else:
            raise AssertionError(f"{page.name}: a <!-- run --> block must be sh or python, not {lang!r}")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_tutorial_is_run() -> None:
    assert DOCS / "tutorial.md" in _pages()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_the_pages_examples_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    script = _script(page)
    if "agent-outbox sandbox" in script:
        port = str(_free_port())
    else:
        port = request.getfixturevalue("sandbox").url.rsplit(":", 1)[1].rstrip("/")
    script = SANDBOX_PORT.sub(port, script)
    (tmp_path / "page.sh").write_text(script)
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"PATH": f"{bin_dir}:{env.get('PATH', '')}", "HOME": str(tmp_path)}
    log = tmp_path / "page.log"  # a file, not a pipe: what the page leaves running keeps a pipe open
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "page.sh"],
            cwd=tmp_path,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: whatever it left running is stopped below
        )
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{page.name}: its examples ran past {TIMEOUT_S} s:\n{log.read_text()[-5000:]}")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = log.read_text()
    assert proc.returncode == 0, f"{page.name}: an example failed (exit {proc.returncode}):\n{out[-5000:]}"
