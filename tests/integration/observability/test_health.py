"""`agent-outbox health --heartbeat`: the liveness probe of the processes without HTTP (Kubernetes
exec probes, compose healthchecks). Real processes: a Celery worker (prefork, as deployed), the
relay and beat each keep their heartbeat fresh from their own loop; a frozen one (SIGSTOP, a hang
the kernel cannot tell from work) goes stale and the probe fails; thawed, it passes again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests import spawn
from tests.harness import wait_for
from workers.ground.heartbeat import age_s

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
MAX_AGE_S = 6.0  # the loops beat every 2 s


def probe(path: object, max_age_s: float = MAX_AGE_S) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "workers.cli.main", "health", "--heartbeat", str(path), "--max-age", str(max_age_s)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_a_frozen_worker_or_relay_fails_its_probe_and_passes_again_when_thawed(pipe, tmp_path):
    worker_hb, relay_hb, beat_hb = tmp_path / "worker.hb", tmp_path / "relay.hb", tmp_path / "beat.hb"
    worker = pipe.start_worker(pool="prefork", concurrency=1, extra_env={"OUTBOX_HEARTBEAT_FILE": str(worker_hb)})
    env = dict(os.environ) | pipe.env
    relay = spawn.popen(
        [sys.executable, "-m", "workers.cli.main", "relay"], env=env | {"OUTBOX_HEARTBEAT_FILE": str(relay_hb)},
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    beat = spawn.popen(
        [sys.executable, "-m", "celery", "-A", "workers", "beat", "--schedule", str(tmp_path / "schedule")],
        env=env | {"OUTBOX_HEARTBEAT_FILE": str(beat_hb)}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for hb in (worker_hb, relay_hb, beat_hb):
            wait_for(lambda hb=hb: age_s(hb) is not None, 30, what=f"{hb.name} written")
        fresh = probe(worker_hb)
        assert fresh.returncode == 0 and fresh.stdout.startswith("heartbeat: ok"), fresh.stdout
        assert probe(relay_hb).returncode == 0 and probe(beat_hb, 30).returncode == 0
        # A beat every 2 s: the file is touched again and again, not once at start.
        first = worker_hb.stat().st_mtime
        wait_for(lambda: worker_hb.stat().st_mtime > first, 10, what="the worker's next beat")

        worker.freeze()
        relay.send_signal(signal.SIGSTOP)
        wait_for(lambda: (age_s(worker_hb) or 0) > MAX_AGE_S and (age_s(relay_hb) or 0) > MAX_AGE_S, 20, what="stale")
        for hb in (worker_hb, relay_hb):
            stale = probe(hb)
            assert stale.returncode == 1 and "its loop is stuck" in stale.stdout, stale.stdout

        worker.thaw()
        relay.send_signal(signal.SIGCONT)
        wait_for(lambda: probe(worker_hb).returncode == 0 and probe(relay_hb).returncode == 0, 20, what="fresh again")
    finally:
        worker.thaw()
        for proc in (relay, beat):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_probe_says_what_is_wrong(tmp_path, monkeypatch):
    missing = probe(tmp_path / "never")
    assert missing.returncode == 1 and "does not exist" in missing.stdout
    nothing = spawn.run(
        [sys.executable, "-m", "workers.cli.main", "health"], capture_output=True, text=True, timeout=30
    )
    assert nothing.returncode == 2 and "--heartbeat" in nothing.stdout
