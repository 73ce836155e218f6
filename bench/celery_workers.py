"""Start real Celery worker processes for benchmarks and know when they are ready.

``python -m bench.celery_workers <ready-file> <celery worker argv...>`` runs Celery's own CLI
after hooking the ``worker_ready`` signal to write ``ready-file``, so benchmarks can run workers at
loglevel WARNING (Celery logs "ready." at INFO) and still wait for them. ``Workers`` starts either
one prefork worker with ``-c W`` or W solo workers, and reads each process's RSS afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.loads.procs import _children, _rss_kib  # noqa: E402

FAST_FLAGS = ["--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"]


def _smaps_kib(pid: int, field: str) -> int | None:
    """A field of /proc/PID/smaps_rollup: Pss (shared pages split among their users) or the
    process's own pages (Private_Clean + Private_Dirty, its USS)."""
    try:
        rows = dict(
            (line.split(":")[0], int(line.split()[1]))
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
        )
    except (OSError, ValueError, IndexError):
        return None
    if field == "Uss":
        return rows.get("Private_Clean", 0) + rows.get("Private_Dirty", 0)
    return rows.get(field)


@dataclass
class Workers:
    """``pool`` = "prefork" (one parent, ``count`` children) or "solo" (``count`` processes);
    ``nodes`` such worker nodes (``celery worker`` instances), as on that many machines."""

    app: str
    pool: str
    count: int
    env: dict[str, str]
    tmp: Path
    queues: str | None = None
    nodes: int = 1
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ready_files: list[Path] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start(self, timeout_s: float = 60.0) -> Workers:
        n_procs, conc = (self.nodes, self.count) if self.pool == "prefork" else (self.count * self.nodes, 1)
        for i in range(n_procs):
            tag = f"{self.pool}{self.count}-{i}-{uuid.uuid4().hex[:6]}"
            ready, log = self.tmp / f"{tag}.ready", self.tmp / f"{tag}.log"
            cmd = [
                sys.executable,
                "-m",
                "bench.celery_workers",
                str(ready),
                "-A",
                self.app,
                "worker",
                "-P",
                self.pool,
                "-c",
                str(conc),
                "-n",
                f"{tag}@%h",
                *FAST_FLAGS,
            ]
            if self.queues:
                cmd += ["-Q", self.queues]
            env = dict(os.environ) | self.env | {"PYTHONPATH": str(ROOT)}
            self.procs.append(
                subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
            )
            self.ready_files.append(ready)
            self.logs.append(log)
        deadline = time.monotonic() + timeout_s
        while not all(f.exists() for f in self.ready_files):
            for p, log in zip(self.procs, self.logs):
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited {p.returncode}: {log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("workers not ready")
            time.sleep(0.05)
        return self

    def worker_pids(self) -> list[int]:
        """The processes that execute tasks: prefork children, or the solo processes."""
        if self.pool == "prefork":
            return [c for p in self.procs for c in _children(p.pid)]
        return [p.pid for p in self.procs]

    def rss_kib(self) -> dict[str, list[int]]:
        pids = self.worker_pids()
        out = {"executing": [r for r in map(_rss_kib, pids) if r]}
        # What a task process costs beyond what it shares with its parent and siblings.
        out["executing_uss"] = [r for r in (_smaps_kib(p, "Uss") for p in pids) if r]
        out["executing_pss"] = [r for r in (_smaps_kib(p, "Pss") for p in pids) if r]
        if self.pool == "prefork":
            out["parent"] = [r for r in (_rss_kib(p.pid) for p in self.procs) if r]
        return out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Workers:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _main() -> None:
    ready = Path(sys.argv[1])
    from celery.signals import worker_ready

    @worker_ready.connect(weak=False)
    def _ready(**_: object) -> None:
        ready.write_text(str(os.getpid()))

    from celery.bin.celery import main

    sys.argv = ["celery", *sys.argv[2:]]
    main()


if __name__ == "__main__":
    _main()
