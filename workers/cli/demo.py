"""``agent-outbox demo``: the whole pipeline on the embedded default, against a faulty provider.

It starts the sandbox provider with a seeded mix of faults (503/429 with Retry-After, commits whose
answer is lost, truncated bodies, business rejections), plays an agent runtime submitting a few
hundred intents (with same-key resubmits and one changed-argument conflict) and three multi-step runs
(a quote drafted then committed, a purchase order, one whose last step is rejected and whose earlier
steps are compensated), runs relay + workers with a progress bar, and ends with what happened and
what the provider counted per key.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import func, select

from outbox.errors import IdempotencyConflict, MissingDependency
from outbox.ledger.intent import Intent
from outbox.ledger.models import Attempt, Operation
from outbox.ledger.submit import submit
from outbox.ledger.typed_outcome import SETTLED, outcome_of
from outbox.settings import load_settings
from producer.client import action_rules_for
from workers.cli.demo_runs import play_runs, runs_table, wait_runs
from workers.cli.ledger import ledger, shown
from workers.cli.pipeline import Pipeline
from workers.sandbox import ServerNotInstalled
from workers.sandbox.scenario import FAULT_MIX, action, actions_doc


def settled(status: str) -> bool:
    """Nothing more will happen without a person: final, or handed off (as every waiter has it)."""
    return outcome_of(status) in SETTLED


# The seeded fault mix on POST /v1/refunds (and friends): each rule fires on a share of calls.
FAULTS: list[dict[str, Any]] = FAULT_MIX


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="the whole pipeline against a faulty sandbox provider (no servers needed)")
    p.add_argument("--intents", type=int, default=300, help="intents the agent submits (default 300)")
    p.add_argument("--seed", type=int, default=7, help="seed of the fault mix and of the agent")
    p.add_argument("--timeout-s", type=float, default=50.0, help="give up waiting after this long")
    p.set_defaults(func=cmd_demo)


def _actions_file(base_url: str, folder: Path) -> Path:
    """The tests' actions document (workers/sandbox/scenario.py) with a larger retry budget, a
    breaker that tolerates the fault mix, and the runs' actions."""
    budget = {"max_attempts": 5, "deadline_s": 120, "base_delay_s": 0.2, "max_delay_s": 2}

    def act(path: str, args: list[str], **extra: Any) -> dict[str, Any]:
        return action(path, settle_s=1, args=args, budget=budget, **extra)

    doc = actions_doc(
        base_url,
        timeout_s=2,
        connect_timeout_s=1,
        breaker={"fail_max": 50, "reset_timeout_s": 5},
        actions={
            "payments.refund.create": act(
                "/v1/refunds", ["order_id", "amount", "currency", "reason"], decimal_args=["amount"]
            ),
            "support.ticket.create": act(
                "/v1/tickets", ["subject", "body", "customer_id", "priority"], sensitive_args=["customer_id"]
            ),
            "notify.email.send": act("/v1/emails", ["to", "subject", "body"], sensitive_args=["to"]),
            # For the runs (workers/cli/demo_runs.py): an order, stock held, a quote drafted then committed.
            "shop.order.create": act("/v1/orders", ["order_ref"]),
            "shop.stock.reserve": act("/v1/reservations", ["sku", "qty"]),
            "shop.cancel": act("/v1/cancellations", ["undoes"]),
            "quote.draft": act("/v1/quotes", ["quote_ref", "amount"], phase="draft"),
            "quote.commit": act("/v1/quote_commits", ["quote_ref"], phase="commit"),
        },
    )
    path = folder / "demo-actions.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _intent(i: int, run: str, rng: random.Random) -> dict[str, Any]:
    kind = rng.random()
    key = f"demo-{run}:case-{i}"
    if kind < 0.6:
        amount = "0.00" if i % 97 == 13 else f"{rng.randint(1, 300)}.{rng.randint(0, 99):02d}"  # 0.00 -> 422
        return dict(
            idempotency_key=key + ":refund:v1",
            action="payments.refund.create",
            args={"order_id": f"order-{i}", "amount": Decimal(amount), "currency": "EUR", "reason": "damaged"},
        )
    if kind < 0.8:
        return dict(
            idempotency_key=key + ":ticket:v1",
            action="support.ticket.create",
            args={
                "subject": f"Case {i}",
                "body": "Customer reports a damaged item",
                "customer_id": f"cus-{i}",
                "priority": "normal",
            },
        )
    return dict(
        idempotency_key=key + ":email:v1",
        action="notify.email.send",
        args={"to": f"customer{i}@example.com", "subject": "Your refund", "body": "It is on its way."},
    )


def cmd_demo(args: argparse.Namespace) -> int:
    try:  # the sandbox's HTTP server: an extra, imported only when the demo runs
        from workers.sandbox.server import bind  # noqa: F401
    except ServerNotInstalled as exc:
        raise MissingDependency(
            f"the demo needs its extra: pip install 'agent-outbox-ledger[demo]' (No module named {exc.name!r})"
        ) from exc
    from workers.sandbox.testing import SandboxServer

    if args.intents < 1:
        from outbox.errors import InvalidIntent

        raise InvalidIntent("--intents", "must be >= 1")
    console = Console(highlight=False)
    run = uuid.uuid4().hex[:6]
    tenant = f"demo-{run}"
    rng = random.Random(args.seed)
    with SandboxServer(seed=args.seed) as sandbox, tempfile.TemporaryDirectory() as tmp:
        for rule in FAULTS:
            sandbox.add_fault(**rule, seed=args.seed)
        os.environ["OUTBOX_ACTIONS_FILE"] = str(_actions_file(sandbox.url, Path(tmp)))
        settings = load_settings()
        log_path = Path(tmp) / "worker.log"
        with ledger(settings) as sessions, open(log_path, "wb") as worker_log:
            console.print(
                f"ledger  {shown(sessions.kw['bind'].url)}\n"
                f"broker  {settings.resolved_broker_url}\n"
                f"sandbox {sandbox.url} with faults: "
                + ", ".join(f"{f['mode']} {f['probability']:.0%}" for f in FAULTS)
            )
            pipeline = Pipeline(settings, loglevel="INFO", worker_output=worker_log.fileno())
            pipeline.start()
            try:
                submitted, resubmits, conflicts, ids = _play_agent(sessions, tenant, args.intents, rng)
                run_ids = play_runs(sessions, f"{tenant}-runs", action_rules_for(settings))
                outcome = _wait(console, sessions, tenant, len(ids), args.timeout_s, pipeline)
                runs_left = wait_runs(console, sessions, run_ids, args.timeout_s, pipeline)
                died = pipeline.died()
            finally:
                pipeline.stop()
            effects = sandbox.effects()
            _summary(console, sessions, tenant, submitted, resubmits, conflicts, ids, effects, outcome)
            runs_table(console, sessions, run_ids, effects)
        if died is not None:
            kept = _keep_log(log_path, settings.data_dir, run)
            unsettled = len(ids) - sum(n for st, n in outcome.items() if settled(st))
            when = f" with {unsettled} operation(s) not settled" if unsettled else ""
            when += f" ({runs_left} run(s) not finished)" if runs_left else ""
            console.print(f"[bold red]{died}{when}.[/] Its last lines:")
            console.print(_tail(kept), markup=False, highlight=False)
            console.print(f"the whole log: {kept}")
            return 1
    console.print(f"explain any operation: agent-outbox ops show <operation_id or key>   (tenant {tenant})")
    console.print(f"explain any run: agent-outbox runs show <run id or key> --tenant {tenant}-runs")
    return 0


def _keep_log(log_path: Path, data_dir: Path, run: str) -> Path:
    """The worker's log outlives the demo's temporary folder when it explains a failure."""
    data_dir.mkdir(parents=True, exist_ok=True)
    kept = data_dir / f"demo-{run}-worker.log"
    kept.write_bytes(log_path.read_bytes() if log_path.exists() else b"")
    return kept


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(the log is empty)"


def _play_agent(sessions, tenant: str, n: int, rng: random.Random):  # type: ignore[no-untyped-def]
    ids: set[str] = set()
    submitted = resubmits = conflicts = 0
    intents = [_intent(i, tenant, rng) for i in range(n)]
    for i, intent in enumerate(intents):
        with sessions.begin() as s:
            ids.add(submit(s, Intent(tenant=tenant, subject="agent:support-bot", run_id=tenant, **intent)).operation_id)
        submitted += 1
        if i % 20 == 7:  # the model calls the same tool twice: same key, same args
            with sessions.begin() as s:
                r = submit(s, Intent(tenant=tenant, subject="agent:support-bot", **intent))
            assert not r.new and r.operation_id in ids
            submitted += 1
            resubmits += 1
    # A changed-argument resubmit with an old key: refused, never silently replayed.
    changed = dict(intents[0])
    changed["args"] = (
        dict(changed["args"]) | {"subject": "changed"}
        if "subject" in changed["args"]
        else dict(changed["args"]) | {"reason": "changed"}
    )
    try:
        with sessions.begin() as s:
            submit(s, Intent(tenant=tenant, subject="agent:support-bot", **changed))
    except IdempotencyConflict:
        conflicts += 1
    submitted += 1
    return submitted, resubmits, conflicts, ids


def _counts(sessions, tenant: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with sessions() as s:
        rows = s.execute(
            select(Operation.status, func.count()).where(Operation.tenant == tenant).group_by(Operation.status)
        ).all()
    return {status: n for status, n in rows}


def _wait(console: Console, sessions, tenant: str, total: int, timeout_s: float, pipeline: Pipeline) -> dict[str, int]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    with Progress(
        TextColumn("[bold]pipeline"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} settled"),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("", total=total)
        while True:
            counts = _counts(sessions, tenant)
            done = sum(n for st, n in counts.items() if settled(st))
            progress.update(
                task,
                completed=done,
                description=" ".join(f"{st}={n}" for st, n in sorted(counts.items()) if not settled(st)),
            )
            if done >= total or time.monotonic() > deadline or not pipeline.alive():
                return counts
            time.sleep(0.25)


def _retries(dispatches: list[Attempt]) -> int:
    """Dispatch attempts after each operation's first (never negative: 0 when nothing was sent)."""
    per_op: dict[str, int] = {}
    for a in dispatches:
        per_op[a.operation_id] = per_op.get(a.operation_id, 0) + 1
    return sum(n - 1 for n in per_op.values())


def _summary(console: Console, sessions, tenant, submitted, resubmits, conflicts, ids, effects, counts) -> None:  # type: ignore[no-untyped-def]
    with sessions() as s:
        attempts = list(
            s.execute(
                select(Attempt)
                .join(Operation, Operation.id == Attempt.operation_id)
                .where(Operation.tenant == tenant)
                .order_by(Attempt.operation_id, Attempt.id)
            ).scalars()
        )
        # By the key the provider saw (tenant-scoped: outbox/ledger/provider_keys.py).
        keys = dict(s.execute(select(Operation.provider_key, Operation.status).where(Operation.tenant == tenant)).all())
        reconciled = s.execute(
            select(func.count(func.distinct(Attempt.operation_id)))
            .join(Operation, Operation.id == Attempt.operation_id)
            .where(Operation.tenant == tenant, Attempt.kind == "lookup")
        ).scalar_one()
    dispatches = [a for a in attempts if a.kind == "dispatch"]
    honoured = violated = 0
    for prev, nxt in zip(dispatches, dispatches[1:]):
        if prev.operation_id == nxt.operation_id and prev.retry_after_s and prev.ended_at and nxt.started_at:
            if (nxt.started_at - prev.ended_at).total_seconds() + 0.001 >= prev.retry_after_s:
                honoured += 1
            else:
                violated += 1
    per_key: dict[str, int] = {}
    for e in effects:
        if e.get("idempotency_key") in keys:
            per_key[e["idempotency_key"]] = per_key.get(e["idempotency_key"], 0) + 1
    duplicates = sum(1 for n in per_key.values() if n > 1)
    succeeded_without_effect = sum(1 for k, st in keys.items() if st == "succeeded" and per_key.get(k, 0) == 0)
    failed_with_effect = sum(1 for k, st in keys.items() if st == "failed_before_commit" and per_key.get(k, 0) > 0)

    table = Table(title="demo result", show_header=False)
    table.add_column("what")
    table.add_column("figure", justify="right")
    rows = [
        ("intents submitted (incl. resubmits and the conflict)", submitted),
        ("same-key resubmits answered with the same operation", resubmits),
        ("changed-argument resubmits refused (idempotency conflict)", conflicts),
        ("operations", len(ids)),
        ("succeeded", counts.get("succeeded", 0)),
        ("failed_before_commit (business rejections, proven)", counts.get("failed_before_commit", 0)),
        ("parked in outcome_unknown at some point, reconciled by lookup", reconciled),
        ("still outcome_unknown", counts.get("outcome_unknown", 0)),
        ("reconciliation_required (handed to a person)", counts.get("reconciliation_required", 0)),
        (
            "not settled yet (not_dispatched / dispatching)",
            counts.get("not_dispatched", 0) + counts.get("dispatching", 0),
        ),
        ("dispatch attempts / retries", f"{len(dispatches)} / {_retries(dispatches)}"),
        ("Retry-After waits honoured / violated", f"{honoured} / {violated}"),
        ("effects counted by the sandbox", sum(per_key.values())),
        ("keys with more than one effect (duplicates)", duplicates),
        ("succeeded without an effect / failed with one", f"{succeeded_without_effect} / {failed_with_effect}"),
    ]
    for what, figure in rows:
        table.add_row(what, str(figure))
    console.print(table)
