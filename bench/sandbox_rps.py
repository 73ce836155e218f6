"""Plain-path throughput of the sandbox: POST /v1/refunds with a unique Idempotency-Key each.

Starts `python -m workers.sandbox` in a subprocess on a free port and drives it with `wrk` (Lua script
for unique keys) when installed, else with an aiohttp client and N concurrent tasks (the Python
client then shares the 2 cores with the server, so the figure is a lower bound). Checks afterwards
that the effects ledger counted one effect per successful request.

    .venv/bin/python -m bench.sandbox_rps [--seconds 10] [--connections 32] [--client wrk|aiohttp]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.sandbox.testing import SandboxProcess  # noqa: E402

BODY = {"order_id": "ord-bench", "amount": "12.50", "currency": "eur", "reason": "bench"}

WRK_SCRIPT = """
local counter = 0
local tid = 0
function setup(thread) thread:set("tid", tid); tid = tid + 1 end
wrk.method = "POST"
wrk.body = '%s'
wrk.headers["Content-Type"] = "application/json"
request = function()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = "bench-" .. tid .. "-" .. counter
  return wrk.format(nil, "/v1/refunds")
end
"""


def run_wrk(url: str, seconds: float, connections: int, threads: int) -> tuple[float, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_SCRIPT % json.dumps(BODY, separators=(",", ":")))
        script = f.name
    try:
        out = subprocess.run(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{int(seconds)}s", "-s", script, url],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        os.unlink(script)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return (float(match.group(1)) if match else 0.0), out


async def run_aiohttp(url: str, seconds: float, connections: int) -> tuple[float, str]:
    """Fallback client; aiohttp's client is several times faster than httpx.AsyncClient here."""
    import aiohttp

    keys = itertools.count()
    done = errors = 0
    body = json.dumps(BODY).encode()
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(url, connector=connector) as session:
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.monotonic() < deadline:
                headers = {"Idempotency-Key": f"bench-{next(keys)}", "Content-Type": "application/json"}
                async with session.post("/v1/refunds", data=body, headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        errors += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.monotonic() - started
    return done / elapsed, f"{done} ok, {errors} errors in {elapsed:.1f}s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (leave a core for the server)")
    parser.add_argument("--client", choices=("wrk", "aiohttp"), default="wrk" if shutil.which("wrk") else "aiohttp")
    args = parser.parse_args()
    with SandboxProcess() as sandbox:
        sandbox.configure(request_log_max=1_000_000)
        if args.client == "wrk":
            rps, detail = run_wrk(sandbox.url, args.seconds, args.connections, args.threads)
        else:
            rps, detail = asyncio.run(run_aiohttp(sandbox.url, args.seconds, args.connections))
        effects = len(sandbox.effects())
        ok = len(sandbox.requests(status=200))
    print(detail.rstrip())
    print(
        f"sandbox plain-path POST /v1/refunds: {rps:.0f} req/s "
        f"(client={args.client}, connections={args.connections}, {os.cpu_count()} cores); "
        f"effects={effects}, 200s in request log={ok}"
    )
    if effects != ok:
        print("MISMATCH: effects ledger and request log disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
