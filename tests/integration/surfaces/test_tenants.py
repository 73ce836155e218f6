"""Tenants are walls (issue 15): provider keys scoped by tenant, per-tenant credentials, masking.

Real workers, relay, PostgreSQL, Redis and the sandbox provider; effects are counted by the sandbox.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests import spawn
from tests.harness import REFUND_ARGS, action, actions_doc, wait_for
from workers.provider.actions import load_actions

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[3]
EMAILS = "/v1/emails"
REFUNDS = "/v1/refunds"


def _cli(pipe: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return spawn.run(
        [sys.executable, "-m", "workers.cli.main", *args],
        cwd=ROOT,
        env=dict(os.environ) | pipe.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _settled(pipe: Any, ids: list[str], timeout_s: float = 30) -> None:
    done = {"succeeded", "failed_before_commit", "cancelled", "reconciliation_required"}
    wait_for(lambda: all(pipe.op(i).status in done for i in ids), timeout_s, what="every operation settled")


def test_two_tenants_with_one_key_make_two_effects(pipe, sandbox):
    pipe.start_worker()
    pipe.start_relay()
    same = [pipe.submit("refund-1", dict(REFUND_ARGS), tenant=t) for t in ("a", "b")]
    other = [
        pipe.submit("refund-2", dict(REFUND_ARGS, amount=amount), tenant=t)
        for t, amount in (("a", "5.00"), ("b", "7.00"))
    ]
    ids = [r.operation_id for r in same + other]
    _settled(pipe, ids)
    ops = [pipe.op(i) for i in ids]
    assert [op.status for op in ops] == ["succeeded"] * 4, [(op.status, op.reason) for op in ops]
    assert [op.provider_key for op in ops] == ["a:refund-1", "b:refund-1", "a:refund-2", "b:refund-2"]
    # One effect each at the provider, each with its own reference: b's refund happened too.
    for op in ops:
        [effect] = sandbox.effects(key=op.provider_key)
        assert op.result_reference == effect["object_id"]
    assert len(sandbox.effects()) == 4 and len({op.result_reference for op in ops}) == 4
    assert sandbox.duplicates() == []
    # The receipt and ops show name the key the provider saw.
    assert same[1].provider_key == "b:refund-1"
    shown = json.loads(_cli(pipe, "ops", "show", ids[1], "--json").stdout)
    assert shown["provider_key"] == "b:refund-1" and shown["idempotency_key"] == "refund-1"


def test_per_tenant_credentials_never_lend_one_tenants_account_to_another(pipe, sandbox):
    doc = actions_doc(sandbox.url)
    doc["targets"]["sandbox"]["tenants"] = {
        "a": {"headers": {"Authorization": "Bearer ${ACCT_A}"}},
        "b": {"headers": {"Authorization": "Bearer ${ACCT_B}"}},
    }
    # Each tenant has its own provider account, so the bare key is allowed (and asked for here).
    doc["actions"]["payments.refund.create"]["provider_key"] = "{idempotency_key}"
    pipe.env.update(ACCT_A="acct-a", ACCT_B="acct-b")
    pipe.write_actions(doc)
    rules = load_actions(pipe.env["OUTBOX_ACTIONS_FILE"], environ=pipe.env)
    pipe.start_worker()
    pipe.start_relay()
    ids = {t: pipe.submit("refund-1", dict(REFUND_ARGS), tenant=t, rules=rules).operation_id for t in "abc"}
    _settled(pipe, list(ids.values()))
    assert pipe.op(ids["a"]).status == pipe.op(ids["b"]).status == "succeeded"
    # Each effect in its own tenant's account (the sandbox scopes by the API key).
    assert [e["idempotency_key"] for e in sandbox.effects(tenant="acct-a")] == ["refund-1"]
    assert [e["idempotency_key"] for e in sandbox.effects(tenant="acct-b")] == ["refund-1"]
    # Tenant c has no credentials: nothing sent, with a reason that names the fix.
    c = pipe.op(ids["c"])
    assert c.status == "failed_before_commit" and "tenant 'c' has no credentials" in (c.last_error or c.reason or "")
    assert len(sandbox.requests(method="POST")) == 2 and len(sandbox.effects()) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SECRET_EMAIL = "canary-7f3e9a@example.invalid"
SECRET_CARD = "4000-canary-8812"
SECRET_TOKEN = "tok-canary-55e1c0ffee"


def test_a_canary_secret_reaches_no_output(pipe, sandbox):
    """Sensitive arguments (nested, in lists) and a target credential appear in no output a person or
    a tool reads: ops show/list, handoffs, the report, worker logs at DEBUG, metrics, the broker."""
    email = action(
        EMAILS,
        sensitive_args=["to", "customer.email", "items[].card"],
        sensitive_response_fields=["to"],
    )
    doc = actions_doc(sandbox.url, actions={"notify.email.send": email})
    doc["targets"]["sandbox"]["headers"] = {"X-Api-Token": "${CANARY_TOKEN}"}
    pipe.env.update(CANARY_TOKEN=SECRET_TOKEN, OUTBOX_RECONCILE_MAX_LOOKUPS="1")
    pipe.write_actions(doc)
    port = _free_port()
    worker = pipe.start_worker(loglevel="DEBUG", extra_env={"OUTBOX_METRICS_PORT": str(port)})
    pipe.start_relay()
    # The provider echoes to, subject and body back: ``to`` by name (masked by path), the card
    # inside the body text (redacted by value, wherever it appears).
    args = {
        "to": SECRET_EMAIL,
        "subject": "hello",
        "body": f"your card {SECRET_CARD} was refunded",
        "customer": {"email": SECRET_EMAIL, "name": "Ada"},
        "items": [{"sku": "s-1", "card": SECRET_CARD}],
    }
    # One succeeds (the provider echoes every argument back), one is handed to a person (committed,
    # its answer lost, every lookup failing): the packet carries the intent.
    sandbox.add_fault(mode="commit_then_drop", method="POST", key_pattern="t1:canary-handoff", count=1)
    sandbox.add_fault(mode="unavailable_503", method="GET", key_pattern="t1:canary-handoff")
    ok = pipe.submit("canary-ok", args, action="notify.email.send").operation_id
    handed = pipe.submit("canary-handoff", dict(args, subject="again"), action="notify.email.send").operation_id
    _settled(pipe, [ok, handed])
    assert pipe.op(ok).status == "succeeded" and pipe.op(handed).status == "reconciliation_required"
    # The provider holds (and answers with) the secrets: they are the arguments. A miss below is no accident.
    held = httpx.get(f"{sandbox.url}{EMAILS}", params={"idempotency_key": "t1:canary-ok"}, timeout=5).text
    assert SECRET_EMAIL in held and SECRET_CARD in held

    outputs: dict[str, str] = {}
    for label, cmd in {
        "ops show ok": ["ops", "show", ok],
        "ops show ok --json": ["ops", "show", ok, "--json"],
        "ops show handed --json": ["ops", "show", handed, "--json"],
        "ops list --json": ["ops", "list", "--json"],
        "handoffs list --json": ["handoffs", "list", "--json"],
        "report --json": ["report", "--json"],
    }.items():
        done = _cli(pipe, *cmd)
        assert done.returncode in (0, 1), (label, done.stderr)
        outputs[label] = done.stdout + done.stderr
    handoff_id = json.loads(outputs["handoffs list --json"])[0]["handoff_id"]
    outputs["handoffs show --json"] = _cli(pipe, "handoffs", "show", str(handoff_id), "--json").stdout
    assert "***" in outputs["handoffs show --json"]  # the packet's intent is there, masked
    outputs["worker log (DEBUG)"] = worker.log()
    outputs["metrics"] = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    client = redis.Redis.from_url(pipe.env["OUTBOX_BROKER_URL"])
    try:
        broker = []
        for key in client.scan_iter(match=f"{pipe.env['OUTBOX_BROKER_KEY_PREFIX']}*"):
            kind = client.type(key).decode()
            if kind == "string":
                broker.append(str(client.get(key)))
            elif kind == "list":
                broker.extend(str(v) for v in client.lrange(key, 0, -1))
            elif kind == "hash":
                broker.extend(str(v) for v in client.hgetall(key).values())
        outputs["broker (Celery task arguments)"] = "\n".join(broker)
    finally:
        client.close()
    with pipe.sessions() as s:
        from sqlalchemy import text

        from outbox.ledger.models import ATTEMPTS, OPERATIONS

        stored = s.execute(text(f"SELECT result::text, last_error FROM {OPERATIONS}")).all()
        stored += s.execute(text(f"SELECT error, NULL FROM {ATTEMPTS}")).all()
    outputs["stored results and errors"] = json.dumps([list(r) for r in stored], default=str)
    assert outputs["ops show ok --json"] and outputs["worker log (DEBUG)"]
    leaks = {
        label: secret
        for label, text in outputs.items()
        for secret in (SECRET_EMAIL, SECRET_CARD, SECRET_TOKEN)
        if secret in text
    }
    assert leaks == {}, leaks
    # What is not sensitive is still shown: masking is not blanket.
    response = json.loads(outputs["ops show ok --json"])["result"]["response"]
    assert (response["to"], response["subject"], response["body"]) == ("***", "hello", "your card *** was refunded")


def test_purge_removes_payload_of_old_terminal_operations_and_keeps_their_story(pipe, sandbox):
    pipe.env["OUTBOX_ARGS_RETENTION_S"] = "90000"  # above the actions file's key retention (86400 s)
    pipe.start_worker()
    pipe.start_relay()
    old = [pipe.submit(f"old-{i}").operation_id for i in range(3)]
    _settled(pipe, old)
    pipe.advance_ledger_clock(90001)  # they finished longer ago than the retention
    young = pipe.submit("young").operation_id
    _settled(pipe, [young])
    before = {i: pipe.op(i) for i in old + [young]}

    dry = _cli(pipe, "purge", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) | {"oldest_finished_at": None, "newest_finished_at": None} == {
        "dry_run": True,
        "older_than_s": 90000.0,
        "operations": 3,
        "handoffs": 0,
        "runs": 0,
        "oldest_finished_at": None,
        "newest_finished_at": None,
    }
    assert all(pipe.op(i).args is not None for i in old)  # a dry run changes nothing

    done = _cli(pipe, "purge", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["operations"] == 3, done.stderr
    assert "purged 3 operation(s) so far" in done.stderr  # progress, on stderr
    for i in old:
        op, was = pipe.op(i), before[i]
        assert op.args is None and op.result is None
        # The story stays: state, digests, reference, attempts, history.
        assert (op.status, op.args_digest, op.result_reference, op.result_digest) == (
            was.status,
            was.args_digest,
            was.result_reference,
            was.result_digest,
        )
        assert pipe.attempts(i, kind="dispatch")
    assert pipe.op(young).args is not None and pipe.op(young).result is not None
    assert json.loads(_cli(pipe, "purge", "--json").stdout)["operations"] == 0  # nothing left to purge
    shown = json.loads(_cli(pipe, "ops", "show", old[0], "--json").stdout)
    assert shown["status"] == "succeeded" and shown["result"]["reference"] == before[old[0]].result_reference

    # A retention shorter than the provider's key retention is refused, naming both settings.
    pipe.env["OUTBOX_ARGS_RETENTION_S"] = "3600"
    short = _cli(pipe, "purge", "--dry-run")
    assert short.returncode == 2
    assert "OUTBOX_ARGS_RETENTION_S=3600" in short.stderr and "provider_idempotency.retention_s=86400" in short.stderr


def test_the_report_maps_each_document_to_its_tenant_never_anothers_record(pipe, sandbox):
    """Per-tenant accounts: tenant a's operation must not answer for a document in b's account with
    the same key; each listing is read with its tenant's credentials."""
    from tests.integration.reconcile.test_report import LISTING, report

    doc = actions_doc(sandbox.url, actions={"payments.refund.create": action(REFUNDS, **{"list": LISTING})})
    doc["targets"]["sandbox"]["tenants"] = {
        "a": {"headers": {"Authorization": "Bearer acct-a"}},
        "b": {"headers": {"Authorization": "Bearer acct-b"}},
    }
    doc["actions"]["payments.refund.create"]["provider_key"] = "{idempotency_key}"
    pipe.write_actions(doc)
    rules = load_actions(pipe.env["OUTBOX_ACTIONS_FILE"])
    pipe.start_worker()
    pipe.start_relay()
    op = pipe.submit("refund-9", dict(REFUND_ARGS), tenant="a", rules=rules).operation_id
    _settled(pipe, [op])
    assert pipe.op(op).status == "succeeded"
    # Someone creates the same key in tenant b's account, outside the outbox.
    planted = httpx.post(
        f"{sandbox.url}{REFUNDS}",
        json=REFUND_ARGS,
        headers={"Idempotency-Key": "refund-9", "Authorization": "Bearer acct-b"},
        timeout=5,
    )
    planted.raise_for_status()
    code, out = report(pipe, "--since", "1h")
    assert code == 1, out
    orphans = out["discrepancies"]["document_without_record"]
    assert [(d["tenant"], d["idempotency_key"], d["why"]) for d in orphans] == [
        ("b", "refund-9", "no operation with this key")
    ]
    assert out["discrepancies"]["record_without_document"] == []  # a's record has a's document
    assert out["by_tenant"] == {
        "b": {"record_without_document": 0, "document_without_record": 1, "duplicates": 0, "state_contradictions": 0}
    }
    assert sorted(x["tenant"] for x in out["listings"]) == ["a", "b"]
