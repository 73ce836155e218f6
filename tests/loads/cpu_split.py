"""Where the CPU went during a measured span: seconds of CPU per kind of process, from /proc.

On 2 cores shared by the submitter, relay, workers, PostgreSQL, Redis and the sandbox, the
throughput of a pipeline is bounded by total CPU per operation; this says which part spends it.

    with CpuSplit() as split:
        ...  # the measured span
    split.seconds  # {"postgres": 3.1, "celery workers": 2.4, ...}
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _kind(cmdline: str, pid: int) -> str | None:
    if pid == os.getpid():
        return "bench process (submitters)"
    if cmdline.startswith("postgres"):
        return "postgres"
    if "redis-server" in cmdline:
        return "redis"
    if "sandbox" in cmdline:
        return "sandbox"
    if "bench.event_sink" in cmdline:
        return "event consumer (Flower's stand-in)"
    if "bench.celery_workers" in cmdline or "celery" in cmdline:
        # A worker on the reconcile queue alone is the reconciler (tests/loads/liveness.py runs both).
        return "reconciler" if "-Q outcome_unknown " in cmdline else "celery workers"
    if "agent-outbox" in cmdline and " relay" in cmdline:
        return "relay"
    return None


def snapshot() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        kind = _kind(cmdline, int(entry.name))
        if kind is None:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (kind, (int(fields[11]) + int(fields[12])) / _TICK)  # utime + stime
    return out


class CpuSplit:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._before: dict[int, tuple[str, float]] = {}

    def __enter__(self) -> CpuSplit:
        self._before = snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        after = snapshot()
        totals: dict[str, float] = {}
        for pid, (kind, cpu) in after.items():
            start = self._before.get(pid, (kind, 0.0))[1]
            totals[kind] = totals.get(kind, 0.0) + cpu - start
        self.seconds = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
