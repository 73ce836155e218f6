"""Using the sandbox from tests: in a background thread, or as a separate process.

    with SandboxServer() as sandbox:
        sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", count=1)
        httpx.post(f"{sandbox.url}/v1/refunds", json={...}, headers={"Idempotency-Key": "k1"})
        assert len(sandbox.effects()) == 1

Both flavours talk to the admin API over HTTP, so a test reads the same numbers either way.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from workers.sandbox.config import SandboxConfig
from workers.sandbox.state import SandboxState


class SandboxAdmin:
    """Admin API client shared by the in-thread and subprocess sandboxes."""

    url: str
    _admin: httpx.Client | None = None

    def _client(self) -> httpx.Client:
        if self._admin is None:
            self._admin = httpx.Client(base_url=self.url, timeout=10.0)
        return self._admin

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._client().request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def reset(self, keep_faults: bool = False) -> None:
        self._call("POST", "/admin/reset", params={"keep_faults": "1"} if keep_faults else None)

    def add_fault(self, **rule: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/admin/faults", json=rule)
        return result

    def faults(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/faults")["data"])

    def remove_fault(self, rule_id: int) -> None:
        self._call("DELETE", f"/admin/faults/{rule_id}")

    def clear_faults(self) -> None:
        self._call("DELETE", "/admin/faults")

    def effects(self, **filters: str) -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/effects", params=filters)["data"])

    def duplicates(self, by: str = "key") -> list[dict[str, Any]]:
        return list(self._call("GET", "/admin/duplicates", params={"by": by})["data"])

    def requests(self, **filters: Any) -> list[dict[str, Any]]:
        params = {k: str(v) for k, v in filters.items()}
        return list(self._call("GET", "/admin/requests", params=params)["data"])

    def configure(self, **settings: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/admin/config", json=settings)
        return result

    def config(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/admin/config")
        return result

    def advance_clock(self, seconds: float) -> None:
        self._call("POST", "/admin/clock", json={"advance_s": seconds})

    def webhooks(self) -> list[dict[str, Any]]:
        """Every signed event the sandbox made, and what became of its sending (status: the receiver's)."""
        return list(self._call("GET", "/admin/webhooks")["data"])

    def release_webhooks(self) -> int:
        """Send the events held back (``webhooks_held``)."""
        return int(self._call("POST", "/admin/webhooks/release")["released"])

    def redeliver_webhook(self, delivery_id: int) -> dict[str, Any]:
        """Send an event again: the same id and body, signed anew (a provider's retry)."""
        result: dict[str, Any] = self._call("POST", f"/admin/webhooks/{delivery_id}/redeliver")
        return result

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None


class SandboxServer(SandboxAdmin):
    """The sandbox on 127.0.0.1 and a free port, served by its own asyncio loop in a thread."""

    def __init__(self, config: SandboxConfig | None = None, seed: int | None = None, host: str = "127.0.0.1") -> None:
        from workers.sandbox.server import bind

        self._state = SandboxState.create(config or SandboxConfig(), seed=seed)
        self._sock = bind(host, 0)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self) -> SandboxServer:
        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            from workers.sandbox.server import start

            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                runner = loop.run_until_complete(start(self._state, self._sock))
            except BaseException as exc:  # surface start-up errors in the caller's thread
                errors.append(exc)
                started.set()
                return
            self._stopped = asyncio.Event()
            started.set()
            loop.run_until_complete(self._stopped.wait())
            loop.run_until_complete(runner.cleanup())
            # Handlers still sleeping in a stall fault: cancel them so the loop closes cleanly.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=serve, name=f"sandbox:{self.port}", daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        self._close_admin()
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> SandboxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class SandboxProcess(SandboxAdmin):
    """`python -m workers.sandbox` in a subprocess on a free port; ready once /admin/health answers.

    Use it when the test must kill or pause the provider, or to keep it off the test's GIL.
    """

    def __init__(
        self, *args: str, host: str = "127.0.0.1", port: int | None = None, startup_timeout_s: float = 15.0
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.args = list(args)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SandboxProcess:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.sandbox", "--host", self.host, "--port", str(self.port), *self.args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"sandbox exited with {self.proc.returncode}: {err}")
            try:
                if httpx.get(f"{self.url}/admin/health", timeout=0.5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sandbox did not answer on {self.url} within {self.startup_timeout_s}s")

    def stop(self) -> None:
        self._close_admin()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> SandboxProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
