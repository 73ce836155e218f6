"""The naive pipeline: what a team would write instead of an outbox (issue 21's second baseline).

One Celery task per intent, enqueued after the business row commits; the task calls the provider with
httpx, retries with tenacity (exponential backoff with jitter) on transport errors, 5xx and 429, goes
through a pybreaker circuit breaker (per process, in memory), and UPDATEs the row's status after the
call. No idempotency key, no fencing, no lookups: the usual first version. Same broker, same
PostgreSQL, same sandbox as the outbox in bench/pipeline_bench.py.

Configured from the environment so its worker processes build the same app:
``BENCH_NAIVE_BROKER_URL``, ``BENCH_NAIVE_PREFIX`` (kombu ``global_keyprefix``), ``BENCH_NAIVE_DB``
(a libpq URL), ``BENCH_NAIVE_SANDBOX``.

    python -m bench.naive_pipeline --faults    # its duplicates and lies under the fault mix

``--faults`` runs it (and only it) under a fault mix at the sandbox and counts what the outbox's tests
count: effects per intent (more than one = a duplicate refund), intents whose row says failed while the
provider made the refund (a lie the agent acts on), and rows never settled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pybreaker
from celery import Celery
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from bench.bare_celery import baseline_conf

BROKER_URL = os.environ.get("BENCH_NAIVE_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_NAIVE_PREFIX", "bench-naive:")
DB = os.environ.get("BENCH_NAIVE_DB", "")
SANDBOX = os.environ.get("BENCH_NAIVE_SANDBOX", "http://127.0.0.1:8900")
QUEUE = "naive"
TABLE = "naive_intents"
SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, amount TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending', reference TEXT, error TEXT)"""

app = Celery("bench_naive", set_as_current=False)
app.conf.update(**baseline_conf(BROKER_URL, PREFIX, QUEUE))

breaker = pybreaker.CircuitBreaker(fail_max=5, reset_timeout=5)
_conn: psycopg.Connection[Any] | None = None
_client: httpx.Client | None = None


class Retryable(Exception):
    """5xx or 429: try again."""


def _db() -> psycopg.Connection[Any]:
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(DB, autocommit=True)
    return _conn


def _http() -> httpx.Client:
    global _client
    if _client is None:
        _client = httpx.Client(base_url=SANDBOX, timeout=httpx.Timeout(1.5, connect=0.5))
    return _client


def _post(body: dict[str, Any]) -> dict[str, Any]:
    response = _http().post("/v1/refunds", json=body)
    if response.status_code >= 500 or response.status_code == 429:
        raise Retryable(f"HTTP {response.status_code}")
    response.raise_for_status()
    return dict(response.json())


@retry(
    stop=stop_after_attempt(5),
    wait=wait_exponential_jitter(multiplier=0.1, max=2, jitter=0.1),
    retry=retry_if_exception_type((httpx.TransportError, Retryable, pybreaker.CircuitBreakerError, ValueError)),
    reraise=True,
)
def call_provider(body: dict[str, Any]) -> dict[str, Any]:
    return breaker.call(_post, body)  # type: ignore[no-any-return]


@app.task(name="bench.naive.refund", ignore_result=True)
def refund(intent_id: int, order_id: str, amount: str) -> None:
    try:
        created = call_provider({"order_id": order_id, "amount": amount, "currency": "EUR", "reason": "bench"})
    except Exception as exc:  # noqa: BLE001 - the naive version: it failed, say so
        _db().execute(f"UPDATE {TABLE} SET status = 'failed', error = %s WHERE id = %s", (repr(exc)[:500], intent_id))
        return
    _db().execute(
        f"UPDATE {TABLE} SET status = 'succeeded', reference = %s WHERE id = %s", (created.get("id"), intent_id)
    )


# ---- the producer side, used by pipeline_bench and --faults ---------------------------------


def configure(prefix: str) -> None:
    """This process's producer on the key prefix its workers read from the environment."""
    app.conf.broker_transport_options = baseline_conf(BROKER_URL, prefix, QUEUE)["broker_transport_options"]


def prepare(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(f"TRUNCATE {TABLE}")


def submit(db_url: str, n: int, *, tag: str) -> None:
    """The business transaction commits the row, then the task is enqueued (the usual pattern; a
    crash between the two loses the intent)."""
    with psycopg.connect(db_url) as conn, app.producer_or_acquire() as producer:
        for i in range(n):
            with conn.transaction():
                row = conn.execute(
                    f"INSERT INTO {TABLE} (order_id, amount) VALUES (%s, %s) RETURNING id", (f"{tag}-{i}", "12.50")
                ).fetchone()
            assert row is not None
            app.send_task("bench.naive.refund", args=[row[0], f"{tag}-{i}", "12.50"], queue=QUEUE, producer=producer)


def settled(db_url: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {TABLE} WHERE status <> 'pending'").fetchone()
    return int(row[0]) if row else 0


def statuses(db_url: str) -> dict[str, str]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return {o: s for o, s in conn.execute(f"SELECT order_id, status FROM {TABLE}").fetchall()}


# The provider's answer lost or garbled after it committed (the cases an outbox exists for), plus
# refusals before commit; probabilities per request, as in tests/loads/liveness.py's mix.
FAULT_MIX: list[dict[str, Any]] = [
    {"mode": "commit_then_drop", "method": "POST", "probability": 0.10},
    {"mode": "commit_then_504", "method": "POST", "probability": 0.08},
    {"mode": "truncated_body", "method": "POST", "probability": 0.05},
    {"mode": "unavailable_503", "method": "POST", "probability": 0.08, "retry_after_s": 0.2},
    {"mode": "fail_before_commit", "method": "POST", "probability": 0.04},
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the naive pipeline under the fault mix: duplicates and lies")
    p.add_argument("--faults", action="store_true", help="run under the sandbox's fault mix (required)")
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    if not args.faults:
        p.error("--faults: the clean throughput is measured by bench.pipeline_bench, beside the outbox")
    import tempfile
    import uuid

    import redis

    from bench.celery_workers import Workers
    from bench.scratch_database import ScratchDatabase
    from workers.sandbox.testing import SandboxProcess

    prefix = f"bench-naive-{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as tmp, ScratchDatabase() as db, SandboxProcess() as sandbox:
        dsn = db.url.replace("postgresql+psycopg://", "postgresql://")
        env = {"BENCH_NAIVE_BROKER_URL": BROKER_URL, "BENCH_NAIVE_PREFIX": prefix, "BENCH_NAIVE_DB": dsn}
        env["BENCH_NAIVE_SANDBOX"] = sandbox.url
        os.environ.update(env)
        configure(prefix)
        for rule in FAULT_MIX:
            sandbox.add_fault(**rule, seed=7)
        prepare(dsn)
        started = time.perf_counter()
        with Workers("bench.naive_pipeline", "prefork", args.workers, env, Path(tmp), queues=QUEUE):
            submit(dsn, args.ops, tag="f")
            deadline = time.monotonic() + args.timeout
            while settled(dsn) < args.ops and time.monotonic() < deadline:
                time.sleep(0.2)
        seconds = time.perf_counter() - started
        rows = statuses(dsn)
        per_order = refunds_per_order(sandbox.url)
        client = redis.Redis.from_url(BROKER_URL)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    out = {
        "benchmark": "naive_pipeline_faults",
        "ops": args.ops,
        "seconds": round(seconds, 1),
        "rows": {s: sum(1 for v in rows.values() if v == s) for s in ("succeeded", "failed", "pending")},
        "refunds_made": sum(per_order.values()),
        # More than one refund for one intent: money paid twice.
        "duplicate_refunds": sum(n - 1 for n in per_order.values() if n > 1),
        "intents_refunded_twice_or_more": sum(1 for n in per_order.values() if n > 1),
        # The row says failed, the provider refunded: the agent tells the customer it failed.
        "failed_but_refunded": sum(1 for o, st in rows.items() if st == "failed" and per_order.get(o, 0) > 0),
        "never_settled": sum(1 for st in rows.values() if st == "pending"),
        "fault_mix": FAULT_MIX,
    }
    print(json.dumps(out, indent=2))
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"naive-faults-{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(out, indent=2))
    return 0


def refunds_per_order(sandbox_url: str) -> dict[str, int]:
    """Every refund the provider made, counted per order (its listing, all pages)."""
    counts: dict[str, int] = {}
    after: str | None = None
    with httpx.Client(base_url=sandbox_url, timeout=10) as client:
        while True:
            params: dict[str, Any] = {"created_after": 0, "limit": 100}
            if after:
                params["starting_after"] = after
            page = client.get("/v1/refunds", params=params).json()
            for obj in page["data"]:
                counts[obj["order_id"]] = counts.get(obj["order_id"], 0) + 1
            if not page.get("has_more") or not page["data"]:
                return counts
            after = page["data"][-1]["id"]


if __name__ == "__main__":
    sys.exit(main())
