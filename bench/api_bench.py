"""Intents per second through the HTTP API, beside ``producer.submit`` in the same run (issue 16).

In a throwaway PostgreSQL database (created, migrated, dropped even on Ctrl-C), with
``agent-outbox serve`` (uvicorn; one process, then ``--workers 2``: one per core):

1. ``producer.submit``: one intent per transaction, in this process (the floor: no HTTP at all);
2. ``POST /v1/intents``: one intent per request, from ``--clients`` concurrent HTTP clients;
3. ``POST /v1/intents:batch``: 500 intents per request, one transaction each.

    .venv/bin/python -m bench.api_bench [--intents 2000] [--clients 1 8] [--server-workers 1 2] [--tag T]

Prints a table and writes bench/results/api-<date>.json.

With several server processes, each line also says how the clients' keep-alive connections were
spread over them (Linux, read from /proc while the clients run): uvicorn's processes accept from
one shared socket, and a burst of new connections often lands on one process, which then serves
every request while the other idles. "8 client(s), 2 server processes" is bimodal for that reason
(8/0: about the one-process figure; 4/4: up to 1.8x it), so compare runs of one split.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.scratch_database import ScratchDatabase  # noqa: E402
from tests.loads.procs import _children  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
ARGS = {"order_id": "o-1", "amount": "12.50", "currency": "EUR"}


def _intent(run: str, i: int) -> dict[str, Any]:
    return {"action": "payments.refund.create", "idempotency_key": f"{run}-{i}", "args": ARGS}


def _serve(env: dict[str, str], workers: int = 1) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.cli.main",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--workers",
            str(workers),
        ],
        cwd=ROOT,
        env=os.environ | env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the API server did not start")


def _key(env: dict[str, str]) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.cli.main",
            "keys",
            "create",
            "--tenant",
            "bench",
            "--scope",
            "submit",
            "--json",
        ],
        cwd=ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        check=True,
    )
    return str(json.loads(out.stdout)["key"])


def bench_producer(db_url: str, n: int, tag: str = "") -> float:
    from outbox.ledger.db import make_engine
    from producer.client import Outbox

    outbox = Outbox(make_engine(db_url), default_tenant="bench")
    try:
        started = time.perf_counter()
        for i in range(n):
            outbox.submit(subject="bench", **_intent(f"producer{tag}", i))
        return n / (time.perf_counter() - started)
    finally:
        outbox.close()


def bench_single(
    url: str, key: str, n: int, clients: int, tag: str = "", server: Any = None, processes: int = 1
) -> tuple[float, list[int]]:
    """Intents/s through single POSTs, and how the clients' connections were spread over the
    server's ``processes`` (``server``: its Popen; [] when not read)."""
    headers = {"Authorization": f"Bearer {key}"}
    run = f"single-{clients}{tag}"
    done = threading.Event()
    spread: list[int] = []

    def part(offset: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            for i in range(offset, n, clients):
                c.post("/v1/intents", json=_intent(run, i)).raise_for_status()

    def watch() -> None:  # the fullest of a few samples: every client connected
        while not done.wait(0.2):
            now = connections_per_process(server.pid, int(url.rsplit(":", 1)[1]), processes)
            if sum(now) > sum(spread):
                spread[:] = now

    # Only with several processes: its reads of /proc every 0.2 s would cost the one-process line CPU.
    watcher = threading.Thread(target=watch, daemon=True) if server is not None and processes > 1 else None
    started = time.perf_counter()
    if watcher is not None:
        watcher.start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(part, range(clients)))
    rate = n / (time.perf_counter() - started)
    done.set()
    if watcher is not None:
        watcher.join()
    return rate, spread


def connections_per_process(parent: int, port: int, processes: int) -> list[int]:
    """Established connections to ``port`` held by each of ``parent``'s ``processes`` serving
    children, most first (Linux's /proc; [] elsewhere)."""
    try:
        table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return []
    inodes = set()
    for line in table:
        f = line.split()
        if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":  # local port, ESTABLISHED
            inodes.add(f[9])
    counts = []
    for pid in _children(parent):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        n = 0
        for fd in fds:
            try:
                m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            n += bool(m and m.group(1) in inodes)
        counts.append(n)
    held = sorted((c for c in counts if c), reverse=True)  # children that serve nothing: 0 (padded)
    return held + [0] * (processes - len(held)) if counts else []


def bench_batch(url: str, key: str, n: int, tag: str = "") -> float:
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        for first in range(0, n, 500):
            items = [_intent(f"batch{tag}", i) for i in range(first, min(first + 500, n))]
            r = c.post("/v1/intents:batch", json={"intents": items})
            r.raise_for_status()
            assert all(x["status"] == 201 for x in r.json()["results"])
    return n / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intents", type=int, default=2000)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--server-workers", type=int, nargs="+", default=[1, 2], help="agent-outbox serve --workers to measure"
    )
    p.add_argument("--tag", default="", help="appended to the results file's name (before/after runs of one day)")
    a = p.parse_args(argv)
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU, Python {platform.python_version()}",
        "intents": a.intents,
    }
    with ScratchDatabase() as db:
        env = {
            "OUTBOX_DATABASE_URL": db.url,
            "OUTBOX_API_RATE_PER_S": "1000000",
            "OUTBOX_CONSOLE_SECRET": "bench-" + "0" * 32,  # serve --workers > 1 needs one
        }
        env.pop("OUTBOX_ACTIONS_FILE", None)
        results["producer.submit"] = round(bench_producer(db.url, a.intents), 1)
        print(f"producer.submit (1 per transaction)      {results['producer.submit']:8.1f} intents/s", flush=True)
        key = _key(env)
        best = 0.0
        for workers in a.server_workers:
            proc, url = _serve(env, workers)
            where = f"{workers} server process{'es' if workers > 1 else ''}"
            try:
                for clients in a.clients:
                    raw, spread = bench_single(
                        url, key, a.intents, clients, tag=f"w{workers}", server=proc, processes=workers
                    )
                    rate = round(raw, 1)
                    best = max(best, rate)
                    results[f"POST /v1/intents, {clients} client(s), {where}"] = rate
                    shown = ""
                    if workers > 1 and spread:
                        results[f"connections per server process, {clients} client(s), {where}"] = spread
                        shown = f"  (connections per process: {'/'.join(map(str, spread))})"
                    print(f"POST /v1/intents, {clients} client(s), {where:18} {rate:8.1f} intents/s{shown}", flush=True)
                rate = round(bench_batch(url, key, a.intents, tag=f"w{workers}"), 1)
                results[f"POST /v1/intents:batch (500 per request), {where}"] = rate
                print(f"POST /v1/intents:batch (500 per request), {where:18} {rate:8.1f} intents/s", flush=True)
            finally:
                proc.terminate()
                proc.wait(10)
        results["producer.submit, again"] = round(bench_producer(db.url, a.intents, tag="again"), 1)
        floor = (results["producer.submit"] + results["producer.submit, again"]) / 2
        results["best single-intent POST / producer.submit"] = round(best / floor, 3)
        print(
            f"producer.submit again {results['producer.submit, again']:.1f}/s; best POST /v1/intents "
            f"{best:.1f}/s = {best / floor:.0%} of producer.submit (mean of both)",
            flush=True,
        )
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"api-{dt.date.today().isoformat()}{'-' + a.tag if a.tag else ''}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written: {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
