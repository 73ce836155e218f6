"""Where the CPU went during a measured span: seconds of CPU per kind of process, from /proc.

On 2 cores shared by the submitter, relay, workers, PostgreSQL, Redis and the sandbox, the
throughput of a pipeline is bounded by total CPU per operation; this says which part spends it.

    with CpuSplit() as split:
        ...  # the measured span
    split.seconds  # {"postgres": 3.1, "celery workers": 2.4, ...}
    split.postgres  # {"client backends": 2.2, "autovacuum": 0.3, "wal writer": 0.1, ...}

PostgreSQL's share counts its processes by role (their process titles), and the children that
exited during the span through their postmaster's reaped-children times (an autovacuum worker
lives for one table and is gone before the span ends; so is a client's backend when it
disconnects): "exited" in ``split.postgres``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


# A PostgreSQL process's title (``postgres: <role> ...``) -> the role reported.
_PG_ROLES = {
    "autovacuum": "autovacuum",
    "walwriter": "wal writer",
    "checkpointer": "checkpointer",
    "background writer": "background writer",
    "logical replication": "other",
    "stats": "other",
    "archiver": "other",
}


def _postmaster(cmdline: str) -> bool:
    """The postmaster keeps the command line it was started with; its children retitle themselves
    ``postgres: ...``."""
    argv0 = cmdline.split(" ", 1)[0]
    return argv0.rsplit("/", 1)[-1] == "postgres" and not cmdline.startswith("postgres:")


# A cluster with a cluster_name (Debian's: "15/main") titles its processes "postgres: 15/main: <role>".
_CLUSTER = re.compile(r"^\S+: ")


def _pg_role(cmdline: str) -> str:
    title = cmdline.removeprefix("postgres: ")
    for candidate in (title, _CLUSTER.sub("", title, count=1)):
        for prefix, role in _PG_ROLES.items():
            if candidate.startswith(prefix):
                return role
    return "client backends"


def _kind(cmdline: str, pid: int) -> str | None:
    if pid == os.getpid():
        return "bench process (submitters)"
    if cmdline.startswith("postgres") or _postmaster(cmdline):
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


def snapshot(roles: dict[int, str] | None = None) -> dict[int, tuple[str, float]]:
    """{pid: (kind, CPU seconds)}; ``roles``, when given, gets each PostgreSQL process's role. A
    postmaster counts its own time and its reaped children's (role "exited")."""
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
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if kind == "postgres" and _postmaster(cmdline):
            ticks += int(fields[13]) + int(fields[14])  # cutime + cstime: children it has reaped
        out[int(entry.name)] = (kind, ticks / _TICK)
        if roles is not None and kind == "postgres":
            roles[int(entry.name)] = "exited" if _postmaster(cmdline) else _pg_role(cmdline)
    return out


class CpuSplit:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.postgres: dict[str, float] = {}  # PostgreSQL's seconds by role (module docstring)
        self._before: dict[int, tuple[str, float]] = {}

    def __enter__(self) -> CpuSplit:
        self._before = snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        roles: dict[int, str] = {}
        after = snapshot(roles)
        totals: dict[str, float] = {}
        parts: dict[str, float] = {}
        for pid, (kind, cpu) in after.items():
            spent = cpu - self._before.get(pid, (kind, 0.0))[1]
            totals[kind] = totals.get(kind, 0.0) + spent
            if pid in roles:
                parts[roles[pid]] = parts.get(roles[pid], 0.0) + spent
        self.seconds = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
        self.postgres = {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
