"""Starting and stopping the sandbox's aiohttp server (foreground for the CLI, or embedded).

The one way in to aiohttp: the core install leaves it out (the 'sandbox' extra brings it), so the
CLI and the workers import this module only when a sandbox is served.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from workers.sandbox import ServerNotInstalled

try:
    from aiohttp import web
except ModuleNotFoundError as exc:
    raise ServerNotInstalled(exc.name) from exc

from workers.sandbox.app import make_app
from workers.sandbox.state import SandboxState

log = logging.getLogger(__name__)


async def start(state: SandboxState, sock: socket.socket, access_log: bool = False) -> web.AppRunner:
    """Serve on an already-bound socket (binding first is how callers learn a free port)."""
    # The access log costs a noticeable share of throughput, so it is off unless asked for.
    runner = web.AppRunner(
        make_app(state),
        access_log=logging.getLogger("sandbox.access") if access_log else None,
        handle_signals=False,
        # Stalled fault handlers may sleep for stall_s; stopping must not wait for them.
        shutdown_timeout=0.5,
    )
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve_forever(state: SandboxState, host: str, port: int, access_log: bool = False) -> None:
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    runner = await start(state, sock, access_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # Printed (not logged) so a parent process can wait for this exact line.
    print(f"sandbox listening on http://{host}:{actual_port}", flush=True)
    log.info("sandbox started", extra={"host": host, "port": actual_port})
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
