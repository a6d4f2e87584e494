"""Linux network namespaces as hosts for the multi-host test (tests/test_multihost.py).

:class:`Network` makes one namespace per host name and a switch namespace holding a
bridge; each host gets a veth pair whose switch end is a port of the bridge and whose
host end is ``eth0`` with its own address on a private /24. Nothing is added to the
namespace the tests run in, so parallel runs cannot clash (the names carry the pid and
a random part, and each run draws its own subnet) and deleting the namespaces removes
every link with them. :meth:`Network.cut` and :meth:`Network.restore` take a host's
switch port down and up: its cable pulled out of the switch and plugged back.

Needs ``ip`` (iproute2) and CAP_NET_ADMIN; :func:`unavailable` says why not, for a
skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

__all__ = ["Network", "unavailable"]

BRIDGE = "br0"
HOST_LINK = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can (a probe
    namespace is added and deleted)."""
    if not os.path.exists("/proc/self/ns/net"):
        return "no network namespaces on this system (not Linux?)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"qps-probe-{os.getpid()}-{secrets.token_hex(2)}"
    got = _ip("netns", "add", probe, check=False)
    if got.returncode != 0:
        return f"`ip netns add` failed (needs root or CAP_NET_ADMIN): {got.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Network:
    """Hosts (network namespaces) on one switch; use as a context manager, or call
    :meth:`create` and, always, :meth:`delete`."""

    def __init__(self, hosts: Sequence[str]) -> None:
        tag = f"qps-{os.getpid()}-{secrets.token_hex(2)}"
        self.subnet = f"10.213.{secrets.randbelow(254) + 1}"
        self.switch = f"{tag}-switch"
        #: host name -> namespace name
        self.ns = {h: f"{tag}-{h}" for h in hosts}
        #: host name -> its address
        self.ip = {h: f"{self.subnet}.{10 + k}" for k, h in enumerate(hosts)}
        self._made: list[str] = []

    def port(self, host: str) -> str:
        """The switch end of ``host``'s cable (an interface name of at most 15 bytes)."""
        return f"p{list(self.ns).index(host)}"

    def create(self) -> None:
        """Make the namespaces, the bridge and one cable per host, every link up.

        Raises:
            subprocess.CalledProcessError: an ``ip`` command failed.
        """
        for name in (self.switch, *self.ns.values()):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        sw = self.switch
        _ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        for host, ns in self.ns.items():
            port = self.port(host)
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_LINK,
                "netns", ns)  # fmt: skip
            _ip("-n", sw, "link", "set", port, "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", HOST_LINK)
            _ip("-n", ns, "link", "set", HOST_LINK, "up")

    def argv(self, host: str, *command: str) -> list[str]:
        """``command`` run on ``host`` (inside its namespace)."""
        return ["ip", "netns", "exec", self.ns[host], *command]

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable out of the switch: its port goes down, every packet
        to or from the host is lost until :meth:`restore` (TCP connections are not
        reset: they retransmit)."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")

    def restore(self, host: str) -> None:
        """Plug ``host``'s cable back in."""
        _ip("-n", self.switch, "link", "set", self.port(host), "up")

    def link_up(self, host: str) -> bool:
        """Whether ``host``'s switch port is up."""
        got = _ip("-n", self.switch, "-o", "link", "show", self.port(host))
        flags = got.stdout.split("<", 1)[1].split(">", 1)[0].split(",")
        return "UP" in flags

    def delete(self) -> None:
        """Kill whatever still runs in the namespaces (what the tests started there),
        then delete them, which deletes their links; safe to call twice."""
        for name in reversed(self._made):
            pids = _ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            end = time.monotonic() + 5
            while pids and time.monotonic() < end:  # the namespace lives while they do
                pids = _ip("netns", "pids", name, check=False).stdout.split()
                time.sleep(0.05)
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Network:
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()
