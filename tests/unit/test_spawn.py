"""tests/spawn.py: a child forked from the warm server sees what a cold ``python -m`` child sees
(arguments, working directory, environment, standard streams, signal dispositions, exit status),
so the suite's workers and CLI calls are the same programs either way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import spawn

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux-only")

# Run from its own folder (python -m puts the working directory first on the path), which is not
# the server's: the working directory is one of the things compared.
PROBE = [sys.executable, "-m", "spawn_probe"]
HERE = Path(__file__).resolve().parent


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ) | extra


def test_a_forked_child_sees_what_a_cold_one_sees() -> None:
    seen = []
    for how in (spawn.popen, subprocess.Popen):
        proc = how(
            [*PROBE, "a", "b c"],
            env=_env(PROBE_ENV="here"),
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert isinstance(proc, spawn.Forked) == (how is spawn.popen)
        out, err = proc.communicate("a line\n", timeout=60)
        assert proc.returncode == 0 and err.strip() == "to stderr", err
        seen.append(json.loads(out))
    forked, cold = seen
    assert forked.pop("pgrp_is_own") is True  # each forked child leads a group the server kills at the end
    cold.pop("pgrp_is_own")
    assert forked == cold
    assert forked["argv"] == ["a", "b c"] and forked["cwd"] == str(HERE) and forked["env"] == "here"
    assert forked["stdin"] == "a line\n" and forked["main"] == "__main__"
    assert forked["signals"]["SIGPIPE"] == str(signal.SIG_IGN)  # a closed socket raises, it does not kill


def test_exit_status_and_signals_reach_the_caller(tmp_path: Path) -> None:
    done = spawn.run([*PROBE, "exit"], env=_env(PROBE_EXIT="3"), cwd=HERE)
    assert done.returncode == 3
    proc = spawn.popen([sys.executable, "-m", "http.server", "0"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    assert isinstance(proc, spawn.Forked)
    time.sleep(0.3)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL


def test_what_the_interpreter_reads_at_start_up_runs_cold(tmp_path: Path) -> None:
    started = spawn.popen([*PROBE, "exit"], env=_env(PROBE_EXIT="0", PYTHONHASHSEED="1"), cwd=HERE)
    assert isinstance(started, subprocess.Popen) and started.wait(60) == 0
    assert isinstance(spawn.popen([sys.executable, "-c", "pass"]), subprocess.Popen)  # not -m: cold
