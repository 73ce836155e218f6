"""Test processes forked from a warm interpreter instead of started cold.

A test that runs ``python -m celery -A workers worker`` or ``python -m workers.cli.main ...`` pays
about 1.5 s of CPU importing Celery, SQLAlchemy, psycopg, pydantic and the package before its first
line runs; the suite starts several hundred of them. One *fork server* per test process imports
those once, then forks a child per request: the child takes the request's argv, environment, working
directory and standard streams and runs the module as ``python -m`` would (``runpy``), so the program
is the same program reading the same environment. Only what the interpreter decides at start-up is
shared (hash seed, ``-X`` flags); a request that would change that (``PYTHON*`` variables,
``LD_PRELOAD``/libfaketime) or that is not ``sys.executable -m module`` runs cold, through
``subprocess``, as before. ``OUTBOX_TEST_SPAWN=cold`` runs every one cold.

:func:`popen` and :func:`run` mirror ``subprocess.Popen`` and ``subprocess.run`` for what the tests
use (pid, poll, wait, send_signal, terminate, kill, communicate, returncode). A forked child is the
server's child, not the test's: the server reaps it and writes its exit status where :class:`Forked`
reads it. Each child leads its own process group; when the test process ends, the server kills
every group it started, so no worker outlives its test run.
"""

from __future__ import annotations

import atexit
import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent

# Imported once by the server: what every worker and CLI call would import anyway. Nothing here
# reads the environment or opens a connection at import (workers.wiring.tasks builds the Celery
# app from Settings at import, so it is left to each child).
PRELOAD = (
    "celery",
    "celery.bin.celery",
    "celery.apps.worker",
    "celery.worker.consumer",
    "celery.concurrency.prefork",
    "celery.concurrency.solo",
    "kombu.transport.redis",
    "billiard.pool",
    "redis",
    "sqlalchemy",
    "sqlalchemy.dialects.postgresql.psycopg",
    "sqlalchemy.dialects.sqlite",
    "psycopg",
    "httpx",
    "pydantic",
    "tenacity",
    "pybreaker",
    "yaml",
    "rich.console",
    "rich.table",
    "alembic.command",
    "workers.wiring.celery_app",
    "workers.ground.event_sender",
    "workers.ground.logs",
    "workers.ground.metrics",
    "workers.wiring.soft_limit",
    "workers.ground.tracing",
    "workers.wiring.runtime",
    "workers.relay.loop",
    "workers.service",
    "workers.cli.main",
    "workers.cli.pipeline",
)

# Decided by the interpreter at start-up (PYTHON*, the loader's LD_*, libfaketime), or read by a
# preloaded library when it is imported (prometheus_client's multiprocess mode, OpenTelemetry's
# settings): a child forked from the server could not honour them, so a request that changes one
# runs cold.
_COLD_ENV_PREFIXES = ("PYTHON", "LD_", "FAKETIME", "DYLD_", "PROMETHEUS_", "OTEL_")


class Forked:
    """A forked child, with the part of ``subprocess.Popen``'s face the tests use."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        status: Path,
        streams: dict[str, IO[Any]],
        server: subprocess.Popen[bytes] | None = None,
    ):
        self.args = args
        self._server = server
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = streams.get("in")
        self.stdout = streams.get("out")
        self.stderr = streams.get("err")
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                text = self._status.read_text()
            except FileNotFoundError:
                text = ""
            if text:
                self.returncode = int(text)
            elif self._server is not None and self._server.poll() is not None and not _exists(self.pid):
                # The server died before it could say (it is killed with the test process's group):
                # the child is gone too, and how it ended is not known. Say killed.
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.002
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Send ``input`` (stdin=PIPE), read the piped streams to their end, and wait."""
        if self.stdin is not None and not self.stdin.closed:
            writer = self.stdin

            def feed() -> None:
                try:
                    if input:
                        writer.write(input)
                    writer.close()
                except BrokenPipeError:
                    pass

            threading.Thread(target=feed, daemon=True).start()
        found: dict[str, Any] = {}

        def drain(name: str, stream: IO[Any]) -> None:
            found[name] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None and not stream.closed
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return found.get("out"), found.get("err")

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Client:
    """The test process's end of its fork server (started on first use)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)  # the server's: what its interpreter started with
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._status: Path | None = None  # made when the server starts: nothing to clean if all run cold
        self._owner = os.getpid()

    def _start(self) -> socket.socket:
        self._status = Path(tempfile.mkdtemp(prefix="outbox-spawn-"))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server = subprocess.Popen(
            [sys.executable, "-m", "tests.spawn", str(theirs.fileno()), str(self._status)],
            pass_fds=[theirs.fileno()],
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        ready = ours.recv(4096)
        if ready != b"ready":
            raise RuntimeError(f"the fork server did not start: {ready!r}")
        atexit.register(self.close)
        return ours

    def spawn(
        self, args: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int], streams: dict[str, IO[Any]]
    ) -> Forked:
        with self._lock:
            if self._sock is None:
                self._sock = self._start()
            request = json.dumps({"module": args[2], "argv": args[3:], "env": env, "cwd": cwd}).encode()
            socket.send_fds(self._sock, [request], list(fds))
            answer = json.loads(self._sock.recv(65536))
        if "error" in answer:
            raise OSError(answer["error"])
        assert self._status is not None
        return Forked(args, int(answer["pid"]), self._status / answer["status"], streams, self._server)

    def close(self) -> None:
        if self._sock is not None and os.getpid() == self._owner:
            self._sock.close()  # the server kills what is left and exits
            self._sock = None
            if self._server is not None:
                try:
                    self._server.wait(10)
                except subprocess.TimeoutExpired:
                    self._server.kill()
            if self._status is not None:
                shutil.rmtree(self._status, ignore_errors=True)


_client: _Client | None = None


def _forkable(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> bool:
    if os.environ.get("OUTBOX_TEST_SPAWN", "fork") == "cold" or sys.platform != "linux":
        return False
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m":
        return False
    return not any(
        name.startswith(_COLD_ENV_PREFIXES) and env.get(name) != server_env.get(name) for name in {*env, *server_env}
    )


def _fd(target: Any, opened: list[int]) -> int:
    if target is None or target == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if isinstance(target, int):
        return target
    return int(target.fileno())


def popen(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    **cold: Any,
) -> Forked | subprocess.Popen[Any]:
    """``subprocess.Popen(args, ...)``, forked from the warm server where it runs the same program.

    stdin: None (empty), DEVNULL or PIPE; stdout/stderr: None (inherited), DEVNULL, PIPE, a file or a
    descriptor; stderr may be STDOUT. Any other keyword runs the program cold.
    """
    global _client
    if _client is None or _client._owner != os.getpid():
        _client = _Client()
    full_env = dict(os.environ if env is None else env)
    if cold or not _forkable(list(args), full_env, _client.env):
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, **cold)
    opened: list[int] = []
    streams: dict[str, IO[Any]] = {}

    def stream(target: Any, name: str, inherited: int) -> int:
        if target is subprocess.PIPE:
            read, write = os.pipe()
            ours, theirs = (write, read) if name == "in" else (read, write)
            opened.append(theirs)
            raw = open(ours, "wb" if name == "in" else "rb")
            streams[name] = io.TextIOWrapper(raw, errors="replace", write_through=True) if text else raw
            return theirs
        if target is None:
            return inherited
        return _fd(target, opened)

    where = str(cwd or os.getcwd())
    if not os.path.isdir(where):  # as Popen says it, in the caller, not in the child
        raise FileNotFoundError(errno.ENOENT, "no such directory", where)
    if stdin not in (None, subprocess.DEVNULL, subprocess.PIPE):
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    try:
        stdin_fd = stream(stdin if stdin is subprocess.PIPE else subprocess.DEVNULL, "in", 0)
        out_fd = stream(stdout, "out", 1)
        err_fd = out_fd if stderr == subprocess.STDOUT else stream(stderr, "err", 2)
        return _client.spawn(list(args), full_env, where, (stdin_fd, out_fd, err_fd), streams)
    finally:
        for fd in opened:
            os.close(fd)


def run(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **cold: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run``, forked from the warm server where it runs the same program."""
    if cold:
        return subprocess.run(
            args, env=env, cwd=cwd, capture_output=capture_output, text=text, timeout=timeout, check=check, **cold
        )
    pipe = subprocess.PIPE if capture_output else None
    proc = popen(args, env=env, cwd=cwd, stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.wait(), out, err)
    if check:
        done.check_returncode()
    return done


# -- the server ---------------------------------------------------------------------------------


# The signals the server found ignored when it started (the test process's): its children keep them so.
_INHERITED_IGNORED: set[int] = set()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: take the request's streams, place and environment, and run the module."""
    import runpy

    # The signals as a new interpreter started by the test process has them: SIGPIPE and SIGXFSZ
    # ignored (a write to a closed socket raises instead of killing the process: a worker killed by
    # SIGPIPE when Redis restarted was how this was learnt), SIGINT raising KeyboardInterrupt, the
    # rest (SIGCHLD: the server's reaper) at their defaults; but what the test process ignores (and
    # so the server inherited ignored) stays ignored, as across an exec: a suite started in the
    # background of a shell ignores SIGINT, and its cold children do too.
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN if sig in _INHERITED_IGNORED else signal.SIG_DFL)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    inherited_int = signal.SIG_IGN if signal.SIGINT in _INHERITED_IGNORED else signal.default_int_handler
    signal.signal(signal.SIGINT, inherited_int)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    buffered = not os.environ.get("PYTHONUNBUFFERED")
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=False, write_through=not buffered)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), errors="backslashreplace", line_buffering=True)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
    sys.argv = [request["module"], *request["argv"]]
    # What runs as __main__ runs afresh, as in a cold start, preloaded or not: the module itself, or a
    # package's __main__ (the package stays: re-importing it would make a second copy beside its
    # already loaded submodules).
    import importlib.util

    spec = importlib.util.find_spec(request["module"])
    is_package = spec is not None and spec.submodule_search_locations is not None
    sys.modules.pop(f"{request['module']}.__main__" if is_package else request["module"], None)
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # as the interpreter does with an uncaught exception: traceback, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as exit does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: S110  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _serve(sock_fd: int, status_dir: str) -> None:
    """Fork children on request until the test process closes its end (it exits, even by SIGKILL:
    the kernel closes its socket) or SIGTERM/SIGHUP reach this process (its group was told to stop);
    then SIGKILL each child's group and reap them."""
    import importlib

    sock = socket.socket(fileno=sock_fd)
    children: dict[int, str] = {}  # pid -> the name of its status file (pids are reused; names are not)
    early: dict[int, int] = {}  # reaped before it was on the list (a SIGCHLD already pending at fork)

    def write_status(name: str, code: int) -> None:
        part = Path(status_dir) / f".{name}"
        part.write_text(str(code))
        part.rename(Path(status_dir) / name)

    def reap(*_: object, block: bool = False) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            name = children.pop(pid, None)
            if name is None:
                early[pid] = os.waitstatus_to_exitcode(status)
            else:
                write_status(name, os.waitstatus_to_exitcode(status))

    def stop(*_: object) -> None:
        raise SystemExit(0)

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as error:  # renamed or gone: the children import what they need themselves
            print(f"tests.spawn: could not preload {name}: {error}", file=sys.stderr)
    _INHERITED_IGNORED.update(
        s
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)
        if signal.getsignal(s) == signal.SIG_IGN
    )
    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the test process; it closes the socket
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    sock.send(b"ready")
    serial = 0
    try:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            except OSError:
                break
            if not message:
                break
            request = json.loads(message)
            serial += 1
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped once it is on the list
            try:
                pid = os.fork()
            except OSError as error:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                sock.send(json.dumps({"error": str(error)}).encode())
                continue
            if pid == 0:
                sock.close()
                _become(request, fds)
            try:
                os.setpgid(pid, pid)  # as the child does: whichever runs first, the group exists
            except OSError:
                pass  # already its own, or already gone
            name = children[pid] = f"{pid}.{serial}"
            if pid in early:
                write_status(children.pop(pid), early.pop(pid))
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"pid": pid, "status": name}).encode())
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(children):
            for kill, target in ((os.killpg, pid), (os.kill, pid)):
                try:
                    kill(target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        reap(block=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
