"""docker-compose.yml: no Docker engine runs here, so test what can be tested without one.

The file parses, every service has a healthcheck or a restart policy that makes sense, the
configuration goes through OUTBOX_* variables, and every command in it is a real entry point
(run here, outside a container, with --help).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from downstream.actions import load_actions

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_expected_services_exist():
    assert {
        "postgres",
        "redis",
        "migrate",
        "relay",
        "worker",
        "reconciler",
        "beat",
        "api",
        "mcp",
        "flower",
        "sandbox",
    } <= set(SERVICES)


def test_redis_keeps_queues_across_restarts():
    command = " ".join(SERVICES["redis"]["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command


def test_long_running_services_restart_and_servers_have_healthchecks():
    for name, svc in SERVICES.items():
        if name == "migrate":
            assert svc["restart"] == "no"
            continue
        assert svc.get("restart") == "unless-stopped", name
    for name in ("postgres", "redis", "sandbox", "api", "mcp"):
        assert "healthcheck" in SERVICES[name], name


def test_configuration_is_outbox_variables_and_the_actions_file_loads(monkeypatch):
    env = COMPOSE["x-outbox-env"]
    assert all(k.startswith("OUTBOX_") or k.endswith("_TOKEN") for k in env)
    assert env["OUTBOX_DATABASE_URL"].startswith("postgresql+psycopg://")
    monkeypatch.setenv("PAYMENTS_TOKEN", "x")
    path = ROOT / env["OUTBOX_ACTIONS_FILE"].removeprefix("/app/")
    config = load_actions(path)
    assert all(t.base_url.startswith("http://sandbox:") for t in config.targets.values())


def _entry_point(command: list[str]) -> list[str]:
    if command[0] == "agent-outbox":
        sub = [c for c in command[1:] if not c.startswith("-")][:1]
        return [sys.executable, "-m", "commands.main", *sub, "--help"]
    if command[0] == "celery":
        # `celery -A workers worker|flower ...`: the app must load and the subcommand exist.
        return [sys.executable, "-m", "celery", *command[1:4], "--help"]
    raise AssertionError(f"unknown entry point {command[0]}")


@pytest.mark.parametrize("name", sorted(n for n, s in SERVICES.items() if "command" in s and n != "redis"))
def test_every_command_is_a_real_entry_point(name, tmp_path):
    command = SERVICES[name]["command"]
    if command[:4] == ["celery", "-A", "workers", "flower"]:
        pytest.importorskip("flower", reason="flower is installed in the image, optional here")
    result = subprocess.run(
        _entry_point(command),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUTBOX_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_image_installs_flower_as_the_declared_extra():
    # The Dockerfile and the README install Flower through the package's own `flower` extra, so its
    # version range lives in one place (pyproject.toml).
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "flower" in project["optional-dependencies"]
    assert "'.[flower,api,mcp]'" in (ROOT / "Dockerfile").read_text()
    assert {"api", "mcp"} <= set(project["optional-dependencies"])
    assert project["name"] != "agent-outbox"  # taken on PyPI by an unrelated project
    assert project["scripts"]["agent-outbox"] == "commands.main:main"


def test_flower_demands_credentials_and_no_port_binds_to_every_interface_by_default():
    # Flower can revoke tasks and shut workers down: compose refuses to start it without credentials.
    assert SERVICES["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    published = {name: svc["ports"] for name, svc in SERVICES.items() if svc.get("ports")}
    assert {"api", "mcp", "flower", "metrics", "sandbox"} <= set(published)
    for name, ports in published.items():
        for port in ports:
            host = str(port).rsplit(":", 2)[0]
            # An address, not only a port: 127.0.0.1 unless the operator sets OUTBOX_PUBLISH_ADDRESS.
            assert host == "${OUTBOX_PUBLISH_ADDRESS:-127.0.0.1}", (name, port)
