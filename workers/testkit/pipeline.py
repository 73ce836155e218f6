"""A user's actions file run through the real pipeline, for the length of a test (or a session).

What the ``outbox_pipeline`` fixture hands a test (workers/testkit/plugin.py): the embedded default
as the demo runs it (a SQLite ledger and the embedded broker in a temporary folder, the relay in a
thread, one Celery worker process: workers/cli/pipeline.py) on the user's own actions file, whose
targets all point at the provider under test (the sandbox, or a fake of the user's own). A test
submits intents, injects faults through the provider's admin API, waits until each operation is
settled and counts the effects the provider made per key.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from outbox.actions.files import read_yaml
from outbox.errors import ConfigError
from outbox.ledger.intent import Intent
from outbox.ledger.provider_keys import SubmitRules
from outbox.ledger.submit import Receipt
from outbox.settings import Settings, load_settings
from workers.provider.actions import ActionsFile, load_actions, read_actions_file
from workers.sandbox.scenario import FAULT_MIX
from workers.sandbox.testing import SandboxAdmin

# What an unset ${VAR} without a default stands for in a test (a secret absent where tests run).
STAND_IN = "outbox-testkit"
# The relay's poll (SQLite's only signal): a test sees an intent picked up within 0.1 s.
RELAY_POLL_S = "0.1"
_BARE_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ProviderAdmin(SandboxAdmin):
    """A provider of the user's own at ``url`` that serves the sandbox's admin API (/admin/effects,
    /admin/faults, ...), as far as it does."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def stop(self) -> None:
        self._close_admin()


@dataclass(frozen=True)
class Settled:
    """An operation once nothing more happens without a person (final, or handed off)."""

    operation_id: str
    status: str  # succeeded, failed_before_commit, reconciliation_required, ...
    outcome: str  # SUCCEEDED, FAILED_BEFORE_COMMIT, NEEDS_HUMAN, ... (docs/how-to/http-api.md, the typed outcomes)
    model_message: str
    attempts: int
    reference: str | None
    operation: dict[str, Any]  # everything `ops show --json` says, attempts and history included


def point_at(source: Path, provider_url: str, dest: Path, environ: Mapping[str, str]) -> Path:
    """A copy of the actions file at ``dest`` whose every target is ``provider_url``, and whose
    ``${VAR}`` references to variables not set here stand for ``STAND_IN``; problems of the file
    itself fail here, each named (as ``agent-outbox actions check`` names them)."""
    from outbox.actions.files import ActionsFileError

    reading = read_actions_file(source, environ=environ, strict=False)
    data, _ = read_yaml(source)
    if reading.problems:
        raise ActionsFileError(source, reading.problems)
    unset = {name for _, name in reading.unset}

    def stand_in(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: stand_in(v) for k, v in value.items()}
        if isinstance(value, list):
            return [stand_in(v) for v in value]
        if isinstance(value, str):
            return _BARE_REF.sub(lambda m: f"${{{m[1]}:-{STAND_IN}}}" if m[1] in unset else m[0], value)
        return value

    data = stand_in(data)
    for target in data["targets"].values():
        target["base_url"] = provider_url
    dest.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return dest


@contextmanager
def _environment(outbox_vars: Mapping[str, str]) -> Iterator[None]:
    """os.environ with exactly these OUTBOX_* variables (the caller's own, a production database's
    URL perhaps, never reach the test's pipeline), for as long as settings are read."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("OUTBOX_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(outbox_vars)
    try:
        yield
    finally:
        for k in outbox_vars:
            os.environ.pop(k, None)
        os.environ.update(saved)


def fault_mix_rules(seed: int, mix: list[dict[str, Any]] = FAULT_MIX) -> list[dict[str, Any]]:
    """The mix as rules that give every key's first creating request one of its faults, each mode as
    likely as the others (rule i of n fires with probability 1/(n-i) on what the ones before it
    left), drawn from ``seed``; a key's retries and lookups pass."""
    n = len(mix)
    return [
        {k: v for k, v in rule.items() if k != "probability"}
        | {"probability": 1.0 / (n - i), "first_per_key": True, "seed": seed + i}
        for i, rule in enumerate(mix)
    ]


class OutboxPipeline:
    """The pipeline on one actions file against one provider; ``start()`` / ``stop()``."""

    def __init__(self, actions_file: Path, provider: SandboxAdmin, folder: Path, *, tenant: str | None = None) -> None:
        self.source = actions_file
        self.provider = provider
        self.folder = folder
        self.tenant = tenant or f"test-{uuid.uuid4().hex[:8]}"
        self.actions_file = folder / "actions.under-test.yaml"
        self.log_path = folder / "worker.log"
        self._pipeline: Any = None
        self._outbox: Any = None
        self._log: Any = None
        self.actions: ActionsFile | None = None

    def start(self) -> OutboxPipeline:
        from outbox.actions.rules import load_action_rules
        from producer.client import Outbox
        from workers.cli.ledger import open_engine
        from workers.cli.pipeline import Pipeline
        from workers.wiring.builders import start_up_problems

        point_at(self.source, self.provider.url, self.actions_file, os.environ)
        self.actions = load_actions(self.actions_file)
        outbox_vars = {
            "OUTBOX_DATA_DIR": str(self.folder / "data"),
            "OUTBOX_ACTIONS_FILE": str(self.actions_file),
            "OUTBOX_RELAY_POLL_S": RELAY_POLL_S,
        }
        with _environment(outbox_vars):
            settings: Settings = load_settings()
        problems = start_up_problems(settings, self.actions)
        if problems:  # the worker would refuse to start: say why here, not as a test that times out
            raise ConfigError(f"{self.source}: " + "; ".join(problems))
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")} | outbox_vars
        self._log = open(self.log_path, "wb")
        try:
            self._pipeline = Pipeline(
                settings, concurrency=1, loglevel="INFO", env=env, worker_output=self._log.fileno()
            )
            self._pipeline.start()  # the relay migrates the embedded ledger before the worker starts
            self._outbox = Outbox(open_engine(settings), rules=load_action_rules(self.actions_file))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop what was started; each part is released even when stopping another raised."""
        pipeline, outbox, log = self._pipeline, self._outbox, self._log
        self._pipeline = self._outbox = self._log = None
        try:
            if pipeline is not None:
                pipeline.stop()
        finally:
            try:
                if outbox is not None:
                    outbox.close()
            finally:
                if log is not None:
                    log.close()

    # -- what a test does -------------------------------------------------------------------------

    def submit(
        self,
        action: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
        tenant: str | None = None,
        subject: str = "test:outbox-testkit",
        rules: SubmitRules | None = None,
        **fields: Any,
    ) -> Receipt:
        """Submit one intent (``key``: its idempotency key, default a new one each call; ``fields``:
        the rest of ``Intent``'s, such as ``priority``)."""
        if self._outbox is None:
            raise RuntimeError("the pipeline is not running")
        intent = Intent(
            tenant=tenant or self.tenant,
            idempotency_key=key or f"testkit-{uuid.uuid4().hex}",
            action=action,
            args=args,
            subject=subject,
            **fields,
        )
        receipt: Receipt = self._outbox.submit(intent, rules=rules)
        return receipt

    def settle(self, receipt: Receipt | str, *, timeout_s: float = 60.0) -> Settled:
        """Wait until the operation is settled; AssertionError (with the worker's last lines) when it
        is not within ``timeout_s`` or when the pipeline died."""
        from outbox.service import operations, waiting

        if self._outbox is None:
            raise RuntimeError("the pipeline is not running")
        operation_id = receipt if isinstance(receipt, str) else receipt.operation_id
        sessions = self._outbox.sessions
        deadline = time.monotonic() + timeout_s
        while True:
            with sessions() as session:
                if waiting.settled(session, [operation_id]):
                    op = operations.read(session, None, operation_id)
                    break
                died = self._pipeline.died()
                if died is not None or time.monotonic() > deadline:
                    op = operations.read(session, None, operation_id)
                    why = died or f"not settled within {timeout_s:g}s"
                    raise AssertionError(
                        f"operation {operation_id} ({op['status']}): {why}; the worker's last lines:\n{self.worker_log()}"
                    )
            time.sleep(waiting.POLL_S / 2)
        result = op.get("result") or {}
        return Settled(
            operation_id=operation_id,
            status=op["status"],
            outcome=str(op["outcome"]),
            model_message=op["model_message"],
            attempts=op["attempts"],
            reference=result.get("reference"),
            operation=op,
        )

    def effects(self, receipt: Receipt) -> int:
        """The effects the provider counted for this intent's key (the provider key it was sent with)."""
        if self.actions is None or self._outbox is None:
            raise RuntimeError("the pipeline is not running")
        action = self._action_of(receipt)
        if self.actions.action(action).provider_idempotency is None:
            raise ValueError(
                f"{action} sends no idempotency key (no provider_idempotency), so the provider cannot count "
                "its effects per key: count them with outbox_provider.effects() or .duplicates(by='params')"
            )
        return len(self.provider.effects(key=receipt.provider_key or receipt.idempotency_key))

    def inject_fault_mix(self, seed: int = 0, mix: list[dict[str, Any]] = FAULT_MIX) -> list[dict[str, Any]]:
        """Every key's first creating request meets one fault of ``mix`` (default: the demo's: 503
        and 429 with Retry-After, a dropped connection, and answers lost after the provider
        committed), drawn from ``seed``; retries and lookups pass. The rules as the provider added them."""
        return [self.provider.add_fault(**rule) for rule in fault_mix_rules(seed, mix)]

    def inject_fault(self, mode: str, **rule: Any) -> dict[str, Any]:
        """One fault rule (workers/sandbox/README.md, "Fault injection"): ``inject_fault("commit_then_drop", count=1)``."""
        return self.provider.add_fault(mode=mode, **rule)

    def faults_fired(self) -> dict[str, int]:
        """How often each fault mode fired so far."""
        fired: dict[str, int] = {}
        for rule in self.provider.faults():
            fired[rule["mode"]] = fired.get(rule["mode"], 0) + int(rule["fired"])
        return fired

    def worker_log(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(text[-lines:]) or "(the worker's log is empty)"

    def _action_of(self, receipt: Receipt) -> str:
        from outbox.service import operations

        with self._outbox.sessions() as session:
            return str(operations.get(session, None, receipt.operation_id).action)
