"""Where the CPU went during a measured span: seconds of CPU per kind of process, from /proc.

On 2 cores shared by the submitter, relay, workers, PostgreSQL, Redis and the sandbox, the
throughput of a pipeline is bounded by total CPU per operation; this says which part spends it.

    with CpuSplit() as split:
        ...  # the measured span
    split.seconds  # {"postgres": 3.1, "celery workers": 2.4, ...}
    split.postgres  # {"client backends": 2.2, "autovacuum": 0.3, "wal writer": 0.1, ...}
    split.machine  # {"context_switches": 81234, "steal_s": 0.4, "busy_s": 9.6, "idle_s": 0.3}
    split.switches  # {"postgres": 24300, "celery workers": 18300, ...}

PostgreSQL's share counts its processes by role (their process titles), and the children that
exited during the span through their postmaster's reaped-children times (an autovacuum worker
lives for one table and is gone before the span ends; so is a client's backend when it
disconnects): "exited" in ``split.postgres``.

``split.machine`` is the whole machine's over the span (``/proc/stat``): its context switches, the
time the hypervisor gave this VM's vCPUs to others (steal), and its cores' busy and idle seconds. The
same code's CPU per operation moves by half between runs minutes apart on a shared VM; these say
whether a slow run's machine was taken (steal) or switched more (context switches per operation).
``split.switches`` splits the switches by kind of process, as ``seconds`` does. Threads and
processes that ended during the span take theirs with them (a disconnected backend's, the threads of
``--submitters``), so a kind's figure is a floor.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
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


def _processes() -> Iterator[tuple[Path, str, list[str], str]]:
    """Each process of a kind we count: its /proc entry, command line, kind, and the fields of its
    stat line after the command's name (fields[0] is the stat line's third)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone
        kind = _kind(cmdline, int(entry.name))
        if kind is not None:
            yield entry, cmdline, stat[stat.rindex(")") + 2 :].split(), kind


def snapshot(roles: dict[int, str] | None = None) -> dict[int, tuple[str, float]]:
    """{pid: (kind, CPU seconds)}; ``roles``, when given, gets each PostgreSQL process's role. A
    postmaster counts its own time and its reaped children's (role "exited")."""
    out: dict[int, tuple[str, float]] = {}
    for entry, cmdline, fields, kind in _processes():
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        if kind == "postgres" and _postmaster(cmdline):
            ticks += int(fields[13]) + int(fields[14])  # cutime + cstime: children it has reaped
        out[int(entry.name)] = (kind, ticks / _TICK)
        if roles is not None and kind == "postgres":
            roles[int(entry.name)] = "exited" if _postmaster(cmdline) else _pg_role(cmdline)
    return out


def parse_proc_stat(text: str) -> dict[str, float]:
    """Context switches; steal, busy and idle seconds, from the text of ``/proc/stat``."""
    out = {"context_switches": 0.0, "steal_s": 0.0, "busy_s": 0.0, "idle_s": 0.0}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name == "ctxt":
            out["context_switches"] = float(rest)
        elif name == "cpu":
            # user nice system idle iowait irq softirq steal [guest guest_nice: inside user and nice already]
            t = [int(v) / _TICK for v in rest.split()[:8]] + [0.0] * 8
            out["busy_s"] = t[0] + t[1] + t[2] + t[5] + t[6]
            out["idle_s"] = t[3] + t[4]
            out["steal_s"] = t[7]
    return out


def machine() -> dict[str, float]:
    """The machine's counters since boot (``/proc/stat``; in a container, the host's)."""
    try:
        return parse_proc_stat(Path("/proc/stat").read_text())
    except OSError:
        return parse_proc_stat("")


def switches() -> dict[tuple[int, str], tuple[str, int]]:
    """{(pid, start time): (kind, context switches of its live threads)}, voluntary and not
    (/proc/PID/task/*/status). Keyed by start time too, so a process first seen at the end of a span
    is new (all its switches in the span), not one missed at its start."""
    out: dict[tuple[int, str], tuple[str, int]] = {}
    for entry, _cmdline, fields, kind in _processes():
        try:
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue  # gone
        count = 0
        for task in tasks:
            try:
                status = (task / "status").read_text()
            except OSError:
                continue  # a thread that ended while we read
            count += sum(int(line.split(":", 1)[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        started = fields[19]  # the stat line's 22nd: start time, in ticks since boot
        out[(int(entry.name), started)] = (kind, count)
    return out


class CpuSplit:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.postgres: dict[str, float] = {}  # PostgreSQL's seconds by role (module docstring)
        self.machine: dict[str, float] = {}  # the whole machine's (module docstring)
        self._before: dict[int, tuple[str, float]] = {}
        self._machine_before: dict[str, float] = {}
        self.switches: dict[str, int] = {}  # context switches by kind of process (its live threads')
        self._switches_before: dict[tuple[int, str], tuple[str, int]] = {}

    def __enter__(self) -> CpuSplit:
        # The process scan first: its CPU is this process's, and must not count in the span.
        self._switches_before = switches()
        self._machine_before = machine()
        self._before = snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        roles: dict[int, str] = {}
        after = snapshot(roles)
        now = machine()
        by_kind: dict[str, int] = {}
        for key, (kind, count) in switches().items():
            spent = count - self._switches_before.get(key, (kind, 0))[1]
            by_kind[kind] = by_kind.get(kind, 0) + max(0, spent)  # < 0: a thread of it ended
        self.switches = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        self.machine = {k: round(now[k] - self._machine_before.get(k, 0.0), 2) for k in now}
        totals: dict[str, float] = {}
        parts: dict[str, float] = {}
        for pid, (kind, cpu) in after.items():
            spent = cpu - self._before.get(pid, (kind, 0.0))[1]
            totals[kind] = totals.get(kind, 0.0) + spent
            if pid in roles:
                parts[roles[pid]] = parts.get(roles[pid], 0.0) + spent
        self.seconds = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
        self.postgres = {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
