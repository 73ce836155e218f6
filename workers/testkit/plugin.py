"""The pytest plugin of the test kit (entry point ``pytest11``: ``agent-outbox``).

A user's test of their own actions file, in five lines::

    def test_the_refund_happens_once_under_the_fault_mix(outbox_pipeline):
        outbox_pipeline.inject_fault_mix(seed=7)
        refund = outbox_pipeline.submit("payments.refund.create", {"order_id": "o-81", "amount": "25", "currency": "EUR"})
        assert outbox_pipeline.settle(refund).status == "succeeded"
        assert outbox_pipeline.effects(refund) == 1

Configuration, the first found wins:

- the actions file: ``--outbox-actions FILE``, ``OUTBOX_TESTKIT_ACTIONS``, the ini option
  ``outbox_actions`` (relative to the ini file);
- the provider: ``--outbox-provider-url URL``, ``OUTBOX_TESTKIT_PROVIDER_URL``, the ini option
  ``outbox_provider_url``; none: the sandbox provider is started (the ``sandbox`` extra);
- ``outbox_pipeline_scope`` (ini): ``function`` (default: a pipeline per test, stopped at its end) or
  ``module`` / ``session`` (one pipeline for many tests; each test still gets its own tenant, and
  the sandbox forgets the previous test's faults and effects).

Everything the fixtures start is stopped at their teardown. This module imports nothing heavy: a
pytest run that uses none of its fixtures pays for two option groups.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pytest

if TYPE_CHECKING:
    from workers.sandbox.testing import SandboxAdmin
    from workers.testkit.pipeline import OutboxPipeline

ACTIONS_ENV = "OUTBOX_TESTKIT_ACTIONS"
PROVIDER_ENV = "OUTBOX_TESTKIT_PROVIDER_URL"
Scope = Literal["function", "module", "session"]
SCOPES: tuple[Scope, ...] = ("function", "module", "session")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("agent-outbox", "agent-outbox test kit (outbox_pipeline fixture)")
    group.addoption(
        "--outbox-actions",
        metavar="FILE",
        help=f"the actions file outbox_pipeline runs (else ${ACTIONS_ENV}, else the ini option outbox_actions)",
    )
    group.addoption(
        "--outbox-provider-url",
        metavar="URL",
        help=f"a fake provider of your own to point every target at (else ${PROVIDER_ENV}, else the ini "
        "option outbox_provider_url; none: the sandbox provider is started)",
    )
    parser.addini("outbox_actions", "the actions file outbox_pipeline runs (relative to the ini file)", default="")
    parser.addini("outbox_provider_url", "a fake provider of your own (default: the sandbox provider)", default="")
    parser.addini(
        "outbox_pipeline_scope", "function (default), module or session: how long one pipeline runs", default=""
    )


def _setting(config: pytest.Config, option: str, env: str, ini: str) -> tuple[str, Path] | None:
    """The value and the folder a relative path in it is relative to."""
    given = config.getoption(option)
    if given:
        return str(given), Path(config.invocation_params.dir)
    if os.environ.get(env):
        return os.environ[env], Path.cwd()
    value = str(config.getini(ini) or "")
    if value:
        return value, Path(config.inipath).parent if config.inipath else Path(config.rootpath)
    return None


def _scope(fixture_name: str, config: pytest.Config) -> Scope:
    scope = str(config.getini("outbox_pipeline_scope") or "function")
    if scope not in SCOPES:
        raise pytest.UsageError(f"outbox_pipeline_scope = {scope!r}: use one of {', '.join(SCOPES)}")
    return scope


@pytest.fixture(scope="session")
def outbox_actions_file(pytestconfig: pytest.Config) -> Path:
    """The actions file under test (override this fixture to choose it in code)."""
    found = _setting(pytestconfig, "outbox_actions", ACTIONS_ENV, "outbox_actions")
    if found is None:
        pytest.fail(
            f"outbox_pipeline needs an actions file: --outbox-actions FILE, ${ACTIONS_ENV}, or "
            "`outbox_actions = FILE` in the [pytest] ini section",
            pytrace=False,
        )
    value, base = found
    path = (base / value).resolve()
    if not path.is_file():
        pytest.fail(f"the actions file {path} does not exist", pytrace=False)
    return path


@pytest.fixture(scope="session")
def outbox_provider(pytestconfig: pytest.Config) -> Iterator[SandboxAdmin]:
    """The provider every target points at: its admin API (effects(), faults(), add_fault(), ...).
    The sandbox provider, started here, or the fake at the configured URL (not started here)."""
    found = _setting(pytestconfig, "outbox_provider_url", PROVIDER_ENV, "outbox_provider_url")
    if found is not None:
        from workers.testkit.pipeline import ProviderAdmin

        remote = ProviderAdmin(found[0])
        yield remote
        remote.stop()
        return
    from workers.sandbox import ServerNotInstalled

    try:
        from workers.sandbox.testing import SandboxServer

        server = SandboxServer(seed=0)
    except ServerNotInstalled as exc:
        pytest.fail(
            f"the sandbox provider needs its extra: pip install 'agent-outbox-ledger[testkit]' (No module named {exc.name!r})",
            pytrace=False,
        )
    with server:
        yield server


@pytest.fixture(scope=_scope)
def outbox_running_pipeline(
    outbox_actions_file: Path, outbox_provider: SandboxAdmin, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OutboxPipeline]:
    from workers.testkit.pipeline import OutboxPipeline

    pipeline = OutboxPipeline(outbox_actions_file, outbox_provider, tmp_path_factory.mktemp("outbox"))
    pipeline.start()
    try:
        yield pipeline
    finally:
        pipeline.stop()


@pytest.fixture
def outbox_pipeline(outbox_running_pipeline: OutboxPipeline, outbox_provider: SandboxAdmin) -> OutboxPipeline:
    """The user's actions file on the real pipeline (embedded ledger and broker, relay, a worker),
    every target pointed at ``outbox_provider``: ``submit``, ``settle``, ``effects``, ``inject_fault_mix``."""
    from workers.sandbox.testing import SandboxServer

    if isinstance(outbox_provider, SandboxServer):
        outbox_provider.reset()  # a test starts with no faults, objects or effects of another's
    outbox_running_pipeline.tenant = f"test-{uuid.uuid4().hex[:8]}"
    return outbox_running_pipeline
