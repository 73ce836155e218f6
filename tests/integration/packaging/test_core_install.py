"""The core install: `pip install agent-outbox-ledger` with no extra, on a machine without libpq.

The wheel is built from the build context (as tests/integration/packaging/test_image.py builds it) and
installed into a fresh virtual environment beside the distributions its core requirements name, and
nothing else: no aiohttp (the sandbox's server is the `sandbox` extra) and no psycopg implementation
(`PSYCOPG_IMPL=binary` where psycopg-binary is absent is psycopg's own failure when it finds none,
as on a machine without libpq). A SQLite ledger runs the whole pipeline there; what needs an extra
says which one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.integration.packaging.test_image import ROOT, Installed, build_context, install_wheel
from workers.sandbox.testing import SandboxServer

PACKAGES = ("outbox", "producer", "workers", "breaker")


@dataclass(frozen=True)
class Core:
    installed: Installed
    home: Path
    empty: Path  # the working directory: nothing of the project in it

    def env(self, **overrides: str) -> dict[str, str]:
        return {
            "PATH": f"{self.installed.bin}:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "PSYCOPG_IMPL": "binary",  # the only implementation psycopg may load: not installed
            "OUTBOX_DATA_DIR": str(self.home / ".outbox"),
        } | overrides

    def run(self, argv: list[str], timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.empty, env=self.env(**env), capture_output=True, text=True, timeout=timeout_s
        )


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> Core:
    tmp = tmp_path_factory.mktemp("core")
    source = tmp / "source"
    for rel in build_context(ROOT):
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, source / rel)
    installed = install_wheel(tmp, source, set())
    (tmp / "home").mkdir()
    (tmp / "empty").mkdir()
    return Core(installed, tmp / "home", tmp / "empty")


def test_the_wheel_is_typed_licensed_and_its_core_leaves_the_sandbox_and_the_psycopg_build_out(core):
    dist = core.installed.dist
    files = {f.as_posix() for f in dist.files or []}
    assert {f"{p}/py.typed" for p in PACKAGES} <= files  # PEP 561: type checkers read our hints
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    assert dist.metadata.get_all("License-File") == ["LICENSE"]
    (license_file,) = [f for f in dist.files or [] if f.name == "LICENSE"]
    assert "Apache License" in license_file.read_text() and license_file.parent.name == "licenses"
    assert "Typing :: Typed" in dist.metadata.get_all("Classifier")

    requirements = [Requirement(r) for r in dist.requires or []]
    core_deps = {canonicalize_name(r.name): r for r in requirements if r.marker is None}
    assert "aiohttp" not in core_deps
    assert core_deps["psycopg"].extras == set()  # the application picks binary, c or its libpq

    def extra(name: str) -> set[str]:
        return {str(r).split(";")[0] for r in requirements if r.marker and r.marker.evaluate({"extra": name})}

    assert any(r.startswith("aiohttp") for r in extra("sandbox"))
    assert extra("binary") == {"psycopg[binary]<4,>=3.1"}
    assert extra("demo") == {"agent-outbox-ledger[sandbox]"}


def test_the_cli_and_the_workers_import_without_aiohttp_and_without_a_psycopg_implementation(core):
    probe = core.run(
        [
            "python",
            "-c",
            "import importlib.util as u\n"
            "assert u.find_spec('aiohttp') is None and u.find_spec('psycopg_binary') is None\n"
            "try:\n    import psycopg\nexcept ImportError: print('no psycopg implementation')\n"
            "import workers.cli.main as m\n"
            "m.build_parser()\n"
            "import workers.wiring.tasks, workers.dispatch.batch, workers.reconcile.batch, workers.relay.loop\n"
            "import workers.sandbox.testing\n"  # the tests' helper: aiohttp only when serving
            "from producer import *\n"  # the async names are left out where greenlet is missing
            "from producer.remote import OutboxClient\n"  # the HTTP client: httpx and pydantic, core
            "print('imported')",
        ]
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["no", "psycopg", "implementation", "imported"]
    assert core.run(["celery", "-A", "workers", "worker", "--help"]).returncode == 0


def test_the_sandbox_and_the_demo_name_the_extra_they_need(core):
    for argv in (["agent-outbox", "sandbox", "--port", "0"], ["python", "-m", "workers.sandbox", "--port", "0"]):
        result = core.run(argv)
        assert result.returncode == 2, result  # like every command that lacks its extra
        assert "pip install 'agent-outbox-ledger[sandbox]'" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    demo = core.run(["agent-outbox", "demo"])
    assert demo.returncode == 2, demo
    assert demo.stderr.strip() == (
        "agent-outbox: the demo needs its extra: pip install 'agent-outbox-ledger[demo]' (No module named 'aiohttp')"
    )
    serve = core.run(["agent-outbox", "serve"])  # serve and mcp say it the same way
    assert serve.returncode == 2 and "pip install 'agent-outbox-ledger[api]'" in serve.stderr, serve


def test_a_postgresql_ledger_without_a_psycopg_implementation_says_what_to_install(core):
    # Nothing connects: the driver is chosen, and refused, before any connection.
    result = core.run(["agent-outbox", "migrate"], OUTBOX_DATABASE_URL="postgresql+psycopg://outbox@127.0.0.1:1/outbox")
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    message = result.stderr.strip()
    assert message.startswith("agent-outbox: a PostgreSQL ledger needs a psycopg implementation"), message
    assert "pip install 'agent-outbox-ledger[binary]'" in message and "pip install 'psycopg[c]'" in message
    assert "couldn't import requested psycopg 'binary' implementation" in message  # psycopg's own words


def test_a_sqlite_ledger_runs_the_pipeline_on_the_core_install(core, tmp_path):
    """Submit, relay, worker, provider call and its outcome, with neither aiohttp nor psycopg loadable
    in the install (the provider is the sandbox, served from this test's own environment)."""
    with SandboxServer() as sandbox:
        actions = yaml.safe_load((ROOT / "examples" / "actions.yaml").read_text())
        for target in actions["targets"].values():
            target["base_url"] = sandbox.url
        actions_file = tmp_path / "actions.yaml"
        actions_file.write_text(yaml.safe_dump(actions))
        env = {"OUTBOX_ACTIONS_FILE": str(actions_file), "OUTBOX_DATA_DIR": str(tmp_path / "ledger")}
        assert (migrated := core.run(["agent-outbox", "migrate"], **env)).returncode == 0, migrated.stderr
        args = {"order_id": "ord-1", "amount": "12.50", "currency": "EUR", "reason": "damaged"}
        submit = ["agent-outbox", "submit", "--action", "payments.refund.create", "--key", "core-1"]
        assert (submitted := core.run([*submit, "--args", json.dumps(args)], **env)).returncode == 0, submitted.stderr

        log = tmp_path / "run.log"
        with open(log, "wb") as out:
            # Its own process group: whatever happens, the group is killed at the end, so no Celery
            # worker of this pipeline outlives the test (once, in CI, one did).
            pipeline = subprocess.Popen(
                ["agent-outbox", "run"],
                cwd=core.empty,
                env=core.env(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            status, deadline = None, time.monotonic() + 90
            while time.monotonic() < deadline and pipeline.poll() is None:
                shown = core.run(["agent-outbox", "ops", "show", "core-1", "--json"], **env)
                assert shown.returncode == 0, shown.stderr
                status = json.loads(shown.stdout)["status"]
                if status == "succeeded":
                    break
                time.sleep(0.5)
        finally:
            pipeline.send_signal(signal.SIGINT)
            try:
                pipeline.wait(30)
            except subprocess.TimeoutExpired:
                pipeline.kill()
                pipeline.wait(10)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pipeline.pid, signal.SIGKILL)  # the workers it started, if any are left
        assert status == "succeeded", log.read_text()[-3000:]
        assert len(sandbox.effects()) == 1  # one refund, made once
