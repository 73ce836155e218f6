"""The test kit as a user meets it, offline: the example folder's tests pass in a copy of it (a fresh
clone: only the installed package and its pytest plugin), against the sandbox the plugin starts or a
provider of the user's own by URL; nothing they start outlives them; merely installed, the plugin
costs a pytest run nothing; and the plain script submits and waits on a temporary SQLite ledger."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from outbox.settings import load_settings
from workers.cli.pipeline import Pipeline
from workers.sandbox.scenario import action, actions_doc
from workers.sandbox.testing import SandboxServer

ROOT = Path(__file__).resolve().parents[3]


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of our settings, a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") and k != "PYTEST_ADDOPTS"}
    return env | {"HOME": str(tmp_path)} | extra


def processes_of(marker: str) -> list[int]:
    """Processes whose environment mentions ``marker`` (a folder only the run under test used)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def run_example(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    copy = tmp_path / "testkit"
    shutil.copytree(ROOT / "examples" / "testkit", copy)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=copy,
        env=clean_env(tmp_path, TMPDIR=str(tmp_path), **env),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert not processes_of(str(tmp_path)), "a process the example started outlived it"
    return done


def test_the_plugin_is_an_entry_point_that_imports_nothing_heavy() -> None:
    assert "workers.testkit.plugin" in {e.value for e in entry_points(group="pytest11")}
    probe = "import sys, workers.testkit.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] in {0}))"
    heavy = {"sqlalchemy", "celery", "httpx", "aiohttp", "pydantic", "yaml", "outbox", "producer"}
    done = subprocess.run([sys.executable, "-c", probe.format(heavy)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_example_tests_pass_from_a_fresh_copy(tmp_path: Path) -> None:
    done = run_example(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "5 passed" in done.stdout


def test_the_example_runs_against_a_provider_of_ones_own_by_url(tmp_path: Path) -> None:
    """Also: the actions file named on the command line, and a pipeline per test (the default scope)."""
    with SandboxServer(seed=3) as own:  # stands for the user's fake: it serves the sandbox's admin API
        done = run_example(
            tmp_path,
            *("-k", "same_key or lost", "--outbox-actions", "actions.yaml", "-o", "outbox_pipeline_scope=function"),
            OUTBOX_TESTKIT_PROVIDER_URL=own.url,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert "2 passed" in done.stdout
        assert len(list(tmp_path.glob("pytest-of-*/pytest-[0-9]*/outbox[0-9]*"))) == 2  # a pipeline per test
        assert {e["idempotency_key"].split(":", 1)[1] for e in own.effects()} == {"wf-81:refund:v1", "wf-82:refund:v1"}


def test_a_missing_actions_file_is_said_plainly(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("def test_x(outbox_pipeline):\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_x.py"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "outbox_pipeline needs an actions file: --outbox-actions FILE" in done.stdout


def test_the_plain_script_submits_and_waits_for_the_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    with SandboxServer(seed=5) as sandbox:
        doc = actions_doc(
            sandbox.url, actions={"payments.refund.create": action("/v1/refunds", decimal_args=["amount"])}
        )
        actions_file = tmp_path / "actions.yaml"
        actions_file.write_text(yaml.safe_dump(doc))
        ours = {
            "OUTBOX_DATA_DIR": str(tmp_path / "data"),
            "OUTBOX_ACTIONS_FILE": str(actions_file),
            "OUTBOX_RELAY_POLL_S": "0.1",
        }
        for name, value in ours.items():
            monkeypatch.setenv(name, value)
        sandbox.add_fault(mode="commit_then_drop", path="/v1/refunds", count=1)  # the first answer is lost
        pipeline = Pipeline(load_settings(), concurrency=1, env=clean_env(tmp_path, **ours))
        pipeline.start()
        try:
            runs = [
                subprocess.run(
                    [sys.executable, str(ROOT / "examples" / "plain_script.py"), "o-17", "25.00"],
                    cwd=tmp_path,
                    env=clean_env(tmp_path, **ours),
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                for _ in range(2)  # the same order twice: one operation, one refund
            ]
        finally:
            pipeline.stop()
        for done in runs:
            assert done.returncode == 0, done.stdout + done.stderr
            assert "succeeded: Done:" in done.stdout  # a read of its own result
        assert "(new: True)" in runs[0].stdout and "(new: False)" in runs[1].stdout
        assert len(sandbox.effects(key="default:refund:o-17:v1")) == 1
