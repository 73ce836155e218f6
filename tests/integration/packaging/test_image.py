"""The image, replayed without Docker: its build context, its install, every compose command from it.

tests/unit/test_compose.py runs the compose commands from the checkout, where every package is
importable whether the image holds it or not. Here the Dockerfile's COPY lines and .dockerignore
choose the files, pip builds the wheel from exactly those and installs it into a fresh virtual
environment, and each compose service's command runs from a folder with nothing of the project in
it. That environment sees the installed wheel and, beside it, the distributions its requirements
with the Dockerfile's extras name (taken from this checkout's venv instead of downloaded: the same
packages, no network): a command that needs a file, a package or a dependency the image lacks
fails here as it would in the container.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import Distribution, PathDistribution, distribution
from pathlib import Path

import psycopg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sqlalchemy.engine import make_url

from outbox.ledger.models import OPERATIONS
from tests.conftest import scratch_pg_database
from tests.unit.test_compose import SERVICES, interpolated

ROOT = Path(__file__).resolve().parents[3]
IMAGE = "agent-outbox:local"
FROM_IMAGE = sorted(name for name, svc in SERVICES.items() if svc.get("image") == IMAGE)
# What the replay needs from an instruction; anything else in the Dockerfile changes no file we run.
Copy = tuple[list[str], str]  # sources in the context, destination in the image (absolute)


@dataclass(frozen=True)
class Dockerfile:
    copies: list[Copy]
    install_dir: str  # where `pip install` runs (the WORKDIR then)
    install_spec: str  # what it installs, e.g. ".[flower,api,mcp]"


def read_dockerfile(text: str) -> Dockerfile:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    workdir, copies, installs = "/", [], []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        assert instruction != "FROM" or not copies, "a multi-stage build: the replay takes one stage"
        if instruction == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, rest.strip()))
        elif instruction in ("COPY", "ADD"):
            args = json.loads(rest) if rest.lstrip().startswith("[") else shlex.split(rest)
            assert not any(a.startswith("--from") for a in args), "COPY --from: not from the build context"
            *sources, dest = [a for a in args if not a.startswith("--")]
            assert not any(re.search(r"[*?\[]|://", s) for s in sources), f"the replay does not expand {sources}"
            directory = dest.endswith("/") or len(sources) > 1
            dest = posixpath.normpath(posixpath.join(workdir, dest))
            copies.append((sources, dest + "/" if directory else dest))
        elif instruction == "RUN" and re.search(r"\bpip install\b", rest):
            argv = shlex.split(rest)
            specs = [a for a in argv[argv.index("install") + 1 :] if not a.startswith("-")]
            assert len(specs) == 1, f"one thing installed, from the build context: {line}"
            installs.append((workdir, specs[0]))
    assert len(installs) == 1, installs
    return Dockerfile(copies, *installs[0])


def _glob(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match plus `**`) as a regular expression."""
    assert not set("[\\") & set(pattern), f"the replay does not read {pattern!r}"
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            out.append({"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i])))
            i += 1
    return re.compile("".join(out))


def read_dockerignore(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((keep, _glob(pattern)))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    # A pattern that matches a folder leaves out everything in it; the last matching rule decides.
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for keep, rx in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not keep
    return ignored


def build_context(root: Path) -> list[str]:
    """The files `docker build` sends for `root` (relative posix paths)."""
    ignore = root / ".dockerignore"
    rules = read_dockerignore(ignore.read_text()) if ignore.exists() else []
    prune = not any(keep for keep, _ in rules)  # no `!` rule can bring back a file from an ignored folder
    found = []
    for folder, dirs, files in os.walk(root):
        base = Path(folder).relative_to(root).as_posix()
        rel = (lambda name: name) if base == "." else (lambda name: f"{base}/{name}")
        if prune:
            dirs[:] = [d for d in dirs if not _ignored(rel(d), rules)]
        found += [rel(f) for f in files if not _ignored(rel(f), rules)]
    return sorted(found)


def replay_copies(dockerfile: Dockerfile, context: list[str], image_root: Path) -> None:
    for sources, dest in dockerfile.copies:
        for source in sources:
            source = posixpath.normpath(source)
            inside = context if source == "." else [f for f in context if f == source or f.startswith(source + "/")]
            assert inside, f"COPY {source}: not in the build context (.dockerignore?)"
            for rel in inside:
                if rel == source:  # a file
                    target = dest + posixpath.basename(rel) if dest.endswith("/") else dest
                else:
                    target = posixpath.join(dest, rel if source == "." else rel[len(source) + 1 :])
                path = image_root / target.lstrip("/")
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, path)


def _requirement_closure(project: Distribution, extras: set[str]) -> dict[str, Distribution]:
    """The distributions `pip install 'project[extras]'` brings, as this venv has them."""
    found: dict[str, Distribution] = {}
    wanted: dict[str, set[str]] = {}
    own_name, own_extras = canonicalize_name(project.metadata["Name"]), set(extras)
    todo: list[tuple[Distribution, set[str]]] = [(project, extras)]
    while todo:
        dist, dist_extras = todo.pop()
        for requirement in map(Requirement, dist.requires or []):
            environments = [{"extra": e} for e in {"", *dist_extras}]
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            name = canonicalize_name(requirement.name)
            if name == own_name:  # an extra made of the project's other extras (`demo` = `[sandbox]`)
                if more := requirement.extras - own_extras:
                    own_extras |= more
                    todo.append((project, more))
                continue
            if name in found and requirement.extras <= wanted[name]:
                continue
            wanted.setdefault(name, set()).update(requirement.extras)
            found[name] = distribution(name)  # raises if this venv lacks it: it is a dependency
            todo.append((found[name], wanted[name]))
    return found


@dataclass(frozen=True)
class Image:
    root: Path  # the image's file system, as far as the Dockerfile writes it
    workdir: str  # the Dockerfile's WORKDIR where it installs (/app): compose points into it
    source: Path  # what `pip install` installed from (in root)
    bin: Path
    site: Path
    packages: set[str]  # the top-level packages the install put into site-packages
    home: Path
    empty: Path  # the working directory: nothing of the project in it

    def env(self, service: str, **overrides: str) -> dict[str, str]:
        """The service's compose environment, paths in the image mapped into the replay."""
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8"}
        # python:3.11-slim has no libpq: psycopg's pure-Python implementation, which loads this
        # machine's, would not load there. Only the prebuilt one (the `binary` extra) may serve.
        env["PSYCOPG_IMPL"] = "binary"
        declared = interpolated(SERVICES[service].get("environment", {}), {"FLOWER_BASIC_AUTH": "admin:s3cret"})
        for name, value in declared.items():
            value = str(value)
            if value.startswith(self.workdir + "/"):  # a file the image must hold
                assert (self.root / value.lstrip("/")).exists(), f"{service}: {name}={value} is not in the image"
                value = str(self.root / value.lstrip("/"))
            elif value.startswith("/"):  # a folder (a tmpfs, the home) or a file of the container's own
                folder = self.home / value.lstrip("/")
                (folder.parent if name.endswith("_FILE") else folder).mkdir(parents=True, exist_ok=True)
                value = str(self.home / value.lstrip("/"))
            env[name] = value
        return env | overrides

    def run(self, argv: list[str], env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=self.empty, env=env, capture_output=True, text=True, timeout=timeout_s)


@dataclass(frozen=True)
class Installed:
    """A fresh virtual environment holding the wheel built from a source folder."""

    bin: Path
    site: Path
    dist: PathDistribution  # the project's installed metadata
    packages: set[str]  # the top-level packages the install put into site-packages


def install_wheel(tmp: Path, source: Path, extras: set[str]) -> Installed:
    """`pip install 'source[extras]'` into tmp/venv, with the distributions taken from this venv."""
    # The wheel pip builds (build isolation off: this venv's setuptools, no download).
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "wheels", source], check=True)
    (wheel,) = (tmp / "wheels").glob("*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True)
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (dist_info,) = site.glob("*.dist-info")
    installed = PathDistribution(dist_info)
    assert extras <= set(installed.metadata.get_all("Provides-Extra") or []), "pip only warns about an unknown extra"
    packages = {f.parts[0] for f in installed.files or [] if f.suffix == ".py" and f.parts[0] != ".."}

    # Its dependencies, and nothing else, beside it: each one's top-level files, linked from this
    # venv into a folder that a .pth adds to sys.path. Not this venv's site-packages itself: the
    # test-only distributions and the checkout's editable install (a .pth there) would come along.
    deps = tmp / "deps"
    deps.mkdir()
    for dist in _requirement_closure(installed, extras).values():
        base = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (deps / top).exists() and not top.endswith(".pth"):
                (deps / top).symlink_to(base / top)
        for entry in dist.entry_points.select(group="console_scripts"):  # what pip writes into bin/
            script = venv / "bin" / entry.name
            name = entry.attr.split(".")[0]
            script.write_text(f"#!{python}\nimport sys\nfrom {entry.module} import {name}\nsys.exit({entry.attr}())\n")
            script.chmod(0o755)
    (site / "image-dependencies.pth").write_text(f"{deps}\n")
    return Installed(venv / "bin", site, installed, packages)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    tmp = tmp_path_factory.mktemp("image")
    dockerfile = read_dockerfile((ROOT / "Dockerfile").read_text())
    root = tmp / "root"
    replay_copies(dockerfile, build_context(ROOT), root)
    spec = re.fullmatch(r"(?P<path>[^\[]+)(?:\[(?P<extras>[^\]]*)\])?", dockerfile.install_spec)
    assert spec, dockerfile.install_spec
    source = root / posixpath.join(dockerfile.install_dir, spec["path"]).lstrip("/")
    extras = {e.strip() for e in (spec["extras"] or "").split(",") if e.strip()}
    installed = install_wheel(tmp, source, extras)
    (tmp / "home").mkdir()
    (tmp / "empty").mkdir()
    return Image(
        root,
        dockerfile.install_dir,
        source,
        installed.bin,
        installed.site,
        installed.packages,
        tmp / "home",
        tmp / "empty",
    )


def test_the_image_installs_its_packages_and_nothing_of_the_checkout_leaks_in(image):
    # Every package in the build context is in the wheel (pyproject.toml's package list and the
    # context agree), and nothing is imported from the checkout.
    context_packages = {path.parent.name for path in image.source.glob("*/__init__.py")}
    print("top-level packages installed:", sorted(image.packages))
    assert image.packages == context_packages == {"outbox", "producer", "workers", "breaker"}
    probe = image.run(
        [
            "python",
            "-c",
            "import workers.cli.main as m, importlib.util as u; print(m.__file__);"
            "print([m for m in ('tests', 'bench', 'pytest', 'langgraph') if u.find_spec(m)])",
        ],
        image.env("migrate"),
    )
    assert probe.returncode == 0, probe.stderr
    where, leaks = probe.stdout.splitlines()
    assert Path(where).is_relative_to(image.site), where
    # Neither the checkout's other folders nor the distributions only the tests install.
    assert leaks == "[]"


@pytest.mark.parametrize("service", FROM_IMAGE)
def test_every_compose_command_starts_from_the_image(image, service):
    command = interpolated(SERVICES[service]["command"], {})
    result = image.run([*command, "--help"], image.env(service))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout.lower(), result.stdout


@pytest.fixture(scope="module")
def image_ledger(image: Image) -> Iterator[str]:
    """An empty PostgreSQL database that the image's own `agent-outbox migrate` brought to head."""
    with scratch_pg_database(f"outbox_test_image_{uuid.uuid4().hex[:10]}", revision="base") as url:
        env = image.env("migrate", OUTBOX_DATABASE_URL=url)
        result = image.run(interpolated(SERVICES["migrate"]["command"], {}), env)
        assert result.returncode == 0, result.stderr[-3000:]
        yield url


def test_migrate_creates_the_ledger_from_the_image(image_ledger):
    libpq = make_url(image_ledger).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq) as conn:
        assert conn.execute(f"SELECT count(*) FROM {OPERATIONS}").fetchone() == (0,)
        assert conn.execute("SELECT version_num FROM outbox_alembic_version").fetchone() is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with_port(argv: list[str], old: str, new: int) -> list[str]:
    return [
        str(new) if a == old else a.replace(f":{old}/", f":{new}/").replace(f"--port={old}", f"--port={new}")
        for a in argv
    ]


def _port_of(command: list[str]) -> str | None:
    if "--port" in command:
        return command[command.index("--port") + 1]
    return next((a.split("=", 1)[1] for a in command if a.startswith("--port=")), None)


@pytest.mark.parametrize("service", sorted(n for n in FROM_IMAGE if "healthcheck" in SERVICES[n]))
def test_servers_start_from_the_image_and_pass_their_healthchecks(image, image_ledger, redis_url, service):
    """Every service's own command from the image, then its own healthcheck command until it passes:
    the servers over HTTP (on a free port here), the relay, workers and beat by their heartbeat."""
    command: list[str] = interpolated(SERVICES[service]["command"], {})
    kind, *check = SERVICES[service]["healthcheck"]["test"]
    assert kind == "CMD", kind
    port = _port_of(command)
    if port is not None:
        new = _free_port()
        command, check = _with_port(command, port, new), _with_port(check, port, new)
        if "--host" in command:
            command[command.index("--host") + 1] = "127.0.0.1"
    # A file the container keeps in its own /tmp (beat's schedule) lands in the replay's home.
    command = [str(image.home / a.lstrip("/")) if a.startswith("/tmp/") else a for a in command]
    heartbeat = image.home / f"{service}.heartbeat"  # its own: an earlier service's must not pass it
    heartbeat.unlink(missing_ok=True)
    env = image.env(
        service,
        OUTBOX_DATABASE_URL=image_ledger,
        OUTBOX_REDIS_URL=redis_url,
        OUTBOX_BROKER_URL=redis_url,
        OUTBOX_HEARTBEAT_FILE=str(heartbeat),
    )
    if env.get("OUTBOX_METRICS_PORT", "0") != "0":  # compose's fixed port: taken when tests run in parallel
        metrics = _free_port()
        check = _with_port(check, env["OUTBOX_METRICS_PORT"], metrics)
        env["OUTBOX_METRICS_PORT"] = str(metrics)
    log = image.home / f"{service}.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            command, cwd=image.empty, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline, result = time.monotonic() + 45, None
        while time.monotonic() < deadline and server.poll() is None:
            result = image.run(check, env, timeout_s=10)
            if result.returncode == 0:
                break
            time.sleep(0.3)
        assert server.poll() is None, log.read_text()[-3000:]
        assert result is not None and result.returncode == 0, (
            result and (result.stdout[-1000:] + result.stderr[-2000:]),
            log.read_text()[-2000:],
        )
    finally:
        # The whole group: a prefork worker's pool and flower's shell go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
