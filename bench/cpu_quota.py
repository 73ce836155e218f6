"""This process, and every process it starts afterwards, under a CPU quota: how a design holds on a
slower CPU, emulated on this one (issue 35: "ratios that hold on a slower CPU").

A cgroup of its own with a CFS bandwidth limit of ``cores`` CPUs (``cpu.cfs_quota_us`` over a
100 ms ``cpu.cfs_period_us`` under cgroup v1's cpu controller, or ``cpu.max`` under cgroup v2).
Needs root (or a delegated cgroup). What is started before it is entered, and services this
process does not start (the machine's PostgreSQL and Redis), run outside the quota.

    with CpuQuota(1.0):   # at most one CPU's time per wall second for the whole process tree
        ...
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

PERIOD_US = 100_000


def _v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return root
    return None


class CpuQuota:
    def __init__(self, cores: float) -> None:
        if cores <= 0:
            raise SystemExit("--cpu-quota: a positive number of CPUs, e.g. 1 or 0.5")
        self.cores = cores
        self.group: Path | None = None
        self.parent_procs: Path | None = None

    def __enter__(self) -> CpuQuota:
        name = f"outbox-bench-{os.getpid()}"
        quota_us = int(self.cores * PERIOD_US)
        v1 = Path("/sys/fs/cgroup/cpu")
        try:
            if (v1 / "cpu.cfs_quota_us").exists():
                self.group = v1 / name
                self.group.mkdir()
                (self.group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.group / "cpu.cfs_quota_us").write_text(str(quota_us))
                self.parent_procs = v1 / "cgroup.procs"
            elif (root := _v2_root()) is not None:
                self.group = root / name
                self.group.mkdir()
                (self.group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
                self.parent_procs = root / "cgroup.procs"
            else:
                raise SystemExit("--cpu-quota: no cgroup cpu controller here (/sys/fs/cgroup/cpu or cgroup v2)")
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except PermissionError as exc:
            raise SystemExit(f"--cpu-quota needs root or a delegated cgroup: {exc}") from exc
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.group is None or self.parent_procs is None:
            return
        self.parent_procs.write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError:  # a process this run started is still in it: the folder goes when it does
            pass
