"""A PostgreSQL cluster of a bench's (or a fault test's) own: initdb'd in a temporary folder with stock
settings (autovacuum on: the machine's own cluster runs with it off, a CI setting), on a free port.

A test may stop and start it (``stop``/``start``): a restart of one ledger while others run on the
machine's cluster (tests/faults/test_ledger_restart.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType


def _bindir() -> Path:
    try:
        return Path(
            subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not found:
            raise SystemExit(
                "initdb not found (Debian: apt-get install postgresql); or pass --shared-cluster"
            ) from None
        return found[-1].parent


class StockCluster:
    """``with StockCluster() as admin_url:`` a PostgreSQL cluster initdb'd here with stock settings,
    listening on 127.0.0.1 on a free port (trust auth), stopped and removed on exit."""

    def __init__(self, *settings: str) -> None:
        self.settings = settings  # extra server settings, "name=value"
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-soak-pg-"))
        self.data = self.dir / "data"
        self.bindir = _bindir()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{args[0]} failed: {done.stderr.strip() or done.stdout.strip()}")

    def __enter__(self) -> str:
        if self.as_user:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.start()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "server.log"),
            "-o",
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
            + "".join(f" -c {setting}" for setting in self.settings),
            "-w",
            "start",
        )

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def stop(self) -> None:
        """Immediate mode, as after a crash: every connection cut, nothing flushed politely."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.running():  # a test may have left it stopped
                self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
