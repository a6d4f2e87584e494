"""Names for the runs of long-lived processes (PS shards, feeders) that hold a lease in
Redis, and the one liveness test that does not need to wait for a lease to expire.

An owner is ``<host>:<pid>:<random>:<pid namespace>``. The random part tells two runs
with the same pid apart; the PID namespace (the inode of ``/proc/self/ns/pid``) says
where the pid means something: two containers on one host have the same hostname only
by accident, but never the same namespace.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket

__all__ = ["PARENT_ENV", "default_owner", "die_with_parent", "owner_is_dead", "pid_namespace"]

#: set by ``qps train`` in its roles' environment: the launcher's pid
PARENT_ENV = "QPS_LAUNCHER_PID"


def pid_namespace() -> str:
    """This process's PID namespace (``/proc/self/ns/pid``'s inode), or ``-``."""
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "-"


def default_owner() -> str:
    """``<host>:<pid>:<random>:<pid namespace>``: names one run of one process (and says
    where its pid means something: see :func:`owner_is_dead`)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}:{pid_namespace()}"


def owner_is_dead(owner: str) -> bool:
    """Whether ``owner`` (a :func:`default_owner` string) names a process of this host
    and PID namespace that no longer exists, so that what it holds can be taken over at
    once. False whenever that is not certain: another host or namespace, an owner of
    another form, this process, a pid that is alive (even if reused)."""
    try:
        host, pid_text, _, ns = owner.rsplit(":", 3)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname() or ns == "-" or ns != pid_namespace() or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. EPERM: it exists
        return False
    return False


def die_with_parent() -> None:
    """In a role ``qps train`` started (:data:`PARENT_ENV` holds its pid): get SIGTERM
    when the launcher dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), and stop at
    once if it is already gone, so that a crashed launcher leaves no role running on
    (they would train beside the roles of its rerun). A no-op elsewhere."""
    want = os.environ.get(PARENT_ENV, "")
    if not want.isdigit() or not os.path.exists("/proc/self"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(want):  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)
