"""``agent-outbox run`` killed by -9: its Celery worker and the pool's children must not outlive it.

The fault is real: the parent gets SIGKILL (no handler runs), and the test watches the worker's
main process and its pool's children end (the kernel's parent-death signal asks the worker for a warm shutdown).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT_OUTBOX = str(Path(sys.executable).with_name("agent-outbox"))


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
    return alive


def test_a_run_killed_by_sigkill_takes_its_worker_and_the_pool_with_it(tmp_path):
    env = {
        **os.environ,
        "OUTBOX_ACTIONS_FILE": str(ROOT / "examples" / "actions.yaml"),
        "OUTBOX_DATA_DIR": str(tmp_path / "ledger"),
    }
    for name in [k for k in env if k.startswith("OUTBOX_") and k not in ("OUTBOX_ACTIONS_FILE", "OUTBOX_DATA_DIR")]:
        env.pop(name)
    assert subprocess.run([AGENT_OUTBOX, "migrate"], env=env, capture_output=True).returncode == 0
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [AGENT_OUTBOX, "run", "--concurrency", "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker: list[int] = []  # the Celery worker's main process and its pool's children
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not worker:
            assert run.poll() is None, log.read_text()[-3000:]
            for child in _children(run.pid):
                with contextlib.suppress(OSError):
                    if b"celery" in Path(f"/proc/{child}/cmdline").read_bytes() and len(_children(child)) >= 2:
                        worker = [child, *_children(child)]
            time.sleep(0.3)
        assert worker, "no worker with its pool came up:\n" + log.read_text()[-3000:]

        run.send_signal(signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.3)
        left = _alive(worker)
        assert not left, f"processes of the worker outlived 'agent-outbox run' killed by -9: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        for pid in _alive(worker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
