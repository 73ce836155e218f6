"""A provider's rate limit, kept by the whole fleet; an unlimited target beside it, unaffected.

One throwaway database, one sandbox, one relay process and ``--workers`` prefork children (4 worker
processes by default). Two targets on the same sandbox: ``limited`` (refunds, declared
``rate_limit: {per_s: 50, burst: 10}`` in the actions file) and ``free`` (tickets, no limit). The
sandbox enforces a real quota on refunds (``rate_limited_429`` with ``quota_per_s``): 50/s with a burst
of 20, i.e. 429 beyond 70 requests in any trailing second, so a fleet that does not pace collects
429s. The declared burst (10) is below the provider's (20), the margin a deployment leaves for the
time between a call's turn and its arrival (a thread woken late, a connection opened): turns are
given on Redis's clock, arrivals are counted on the provider's.

Scenarios, in this order so that both see the same machine:

1. **free alone**: ``--free`` ticket intents at once; the clock runs to the last one settled;
2. **both**: ``--limited`` refund intents and ``--free`` ticket intents at once. Reports the refunds
   the sandbox created per 5 s window (max, and the goal: <= per_s x 1.05), the 429s it answered,
   the tickets' throughput beside (1.) and the refunds' own throughput (the limit is the ceiling).
3. **undeclared** (``--undeclared``): the same refunds with the limit left out of the actions file:
   what the 429s cost without pacing (attempts, backoff), for comparison.

Checks: one effect per intent, no duplicate key. Writes bench/results/rate-limits-<date>.json.

    .venv/bin/python -m bench.rate_limits [--limited 1500] [--free 3000] [--workers 4] [--undeclared]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench.celery_workers import Workers
from bench.pipeline_bench import ARGS, RESULTS_DIR, Outbox, actions_doc, wait_until
from bench.scratch_database import ScratchDatabase
from tests.harness import max_in_any_window

PER_S = 50.0
BURST = 10
PROVIDER_BURST = 20
WINDOW_S = 5.0
TICKET = {"subject": "bench", "customer_id": "cus-bench", "body": "", "priority": "normal"}


def two_targets_doc(base_url: str, *, declared: bool) -> dict[str, Any]:
    doc = actions_doc(base_url)
    limited = dict(doc["targets"]["sandbox"])
    if declared:
        limited["rate_limit"] = {"per_s": PER_S, "burst": BURST}
    doc["targets"] = {"limited": limited, "free": dict(doc["targets"]["sandbox"])}
    refund = doc["actions"]["payments.refund.create"]
    refund["target"] = "limited"
    ticket = json.loads(json.dumps(refund))
    ticket |= {"target": "free", "request": {"method": "POST", "path": "/v1/tickets"}, "decimal_args": []}
    ticket["lookup"]["request"]["path"] = "/v1/tickets"
    doc["actions"]["support.ticket.create"] = ticket
    return doc


def _submit(ob: Outbox, tenant: str, action: str, args: dict[str, Any], n: int) -> None:
    from producer import submit

    for first in range(0, n, 500):
        with ob.sessions.begin() as s:
            for i in range(first, min(first + 500, n)):
                submit(
                    s, tenant=tenant, idempotency_key=f"{tenant}:{action}:{i}", action=action, args=args, subject="b"
                )


def _settled(ob: Outbox, tenant: str) -> int:
    """Operations at an end (succeeded, or failed: without pacing, a 429 costs an attempt of the budget)."""
    from outbox.ledger.states import TERMINAL

    return sum(n for status, n in ob.statuses(tenant).items() if status in {s.value for s in TERMINAL})


def _windows(created: list[float]) -> list[int]:
    if not created:
        return []
    start = min(created)
    counts = Counter(int((t - start) // WINDOW_S) for t in created)
    last = max(counts)
    return [counts.get(i, 0) for i in range(last)]  # whole windows only (the last one is partial)


def run(ob: Outbox, sandbox: Any, *, limited: int, free: int, log: Any) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    out: dict[str, Any] = {}
    t = f"free-alone-{tag}"
    started = time.perf_counter()
    _submit(ob, t, "support.ticket.create", TICKET, free)
    ended = wait_until(lambda: ob.count(t) >= free, 600, 0.05, "tickets alone settled")
    out["free_alone_ops_per_s"] = round(free / (ended - started), 1)
    log(f"free alone: {out['free_alone_ops_per_s']}/s")
    sandbox.reset(keep_faults=True)
    t = f"both-{tag}"
    started = time.perf_counter()
    refunds = threading.Thread(target=_submit, args=(ob, t, "payments.refund.create", ARGS, limited), daemon=True)
    refunds.start()
    _submit(ob, t, "support.ticket.create", TICKET, free)
    refunds.join()
    tickets_done = wait_until(
        lambda: len(sandbox.effects(resource="tickets")) >= free, 600, 0.05, "tickets beside the refunds"
    )
    refunds_done = wait_until(lambda: _settled(ob, t) >= limited + free, 900, 0.05, "all settled")
    created = sorted(e["created"] for e in sandbox.effects(resource="refunds"))
    windows = _windows(created)
    rules = sandbox.faults()
    out |= {
        "free_beside_ops_per_s": round(free / (tickets_done - started), 1),
        "limited_ops_per_s": round(limited / (refunds_done - started), 1),
        "limited_per_5s_windows": windows,
        "limited_max_window_per_s": round(max(windows) / WINDOW_S, 1) if windows else None,
        "limited_max_in_any_1s": max_in_any_window(created, 1.0),
        "goal_max_per_s": PER_S * 1.05,
        "answered_429": sum(r["fired"] for r in rules if r["mode"] == "rate_limited_429"),
        "statuses": ob.statuses(t),
        "effects": len(sandbox.effects()),
        "expected_effects": limited + free,
        "duplicates": len(sandbox.duplicates(by="key")),
    }
    out["free_beside_over_alone"] = round(out["free_beside_ops_per_s"] / out["free_alone_ops_per_s"], 3)
    log(f"both: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limited", type=int, default=1500)
    parser.add_argument("--free", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=4, help="prefork children of one worker")
    parser.add_argument("--undeclared", action="store_true", help="leave the limit out of the actions file")
    parser.add_argument("--quick", action="store_true", help="300 refunds, 600 tickets")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if args.quick:
        args.limited, args.free = 300, 600

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    from workers.sandbox.testing import SandboxProcess

    with (
        ScratchDatabase() as db,
        tempfile.TemporaryDirectory(prefix="rate-limits-") as tmp,
        SandboxProcess() as sandbox,
    ):
        ob = Outbox(db.url, sandbox.url, Path(tmp), f"bench-rate-{uuid.uuid4().hex[:6]}:")
        Path(ob.env["OUTBOX_ACTIONS_FILE"]).write_text(
            yaml.safe_dump(two_targets_doc(sandbox.url, declared=not args.undeclared), sort_keys=False)
        )
        # The provider's own quota: 50/s with a burst of 20 (the module docstring says why not 10).
        sandbox.add_fault(
            mode="rate_limited_429", method="POST", path="/v1/refunds", quota_per_s=math.ceil(PER_S + PROVIDER_BURST)
        )
        try:
            ob.start_relay()
            with Workers("workers", "prefork", args.workers, ob.env, Path(tmp), queues="dispatch,outcome_unknown"):
                result = run(ob, sandbox, limited=args.limited, free=args.free, log=log)
        finally:
            ob.stop_relay()
            ob.engine.dispose()
    result |= {"limited": args.limited, "free": args.free, "workers": args.workers, "declared": not args.undeclared}
    result |= {"per_s": PER_S, "burst": BURST, "label": args.label}
    print(json.dumps(result, indent=2))
    RESULTS_DIR.mkdir(exist_ok=True)
    name = f"rate-limits-{time.strftime('%Y-%m-%d-%H%M')}{'-undeclared' if args.undeclared else ''}"
    out = RESULTS_DIR / f"{name}{'-' + args.label if args.label else ''}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    lost = result["effects"] != result["expected_effects"] and result["declared"]
    return 1 if result["duplicates"] or lost else 0


if __name__ == "__main__":
    sys.exit(main())
