"""A training job across three hosts: Linux network namespaces on one bridge
(tests/netns.py), each host with its own address. Host ``server`` runs Redis and both PS
shards, hosts ``w0`` and ``w1`` one worker each, every role a `qps` process that reaches
Redis over TCP at the server's address. The job trains the digits example (W4: 2
workers of 1,500 asynchronous steps) to its test accuracy target; midway, w1's cable is
pulled out of the switch and plugged back in.

What it shows: asynchronous training goes on without w1 (the global step advances while
w1 cannot reach Redis, and w1's published step stays where it was); once the link is
back, w1's stalled TCP connections retransmit and it carries on from where it was (its
step advances, it runs all of its steps; a push that waited on a full queue for longer
than the queue's lease was undone by Redis and is sent again, see PSClient._send);
every gradient is applied exactly once (the global step ends at 2 x 1,500); the job
finishes, every process exits 0, and the final parameters reach the target.

The test itself watches the job through a unix socket of the Redis server, which no
cable cut reaches. Skipped where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import qps
from qps.embedded import find_server_binary
from qps.errors import QpsError
from qps.ps import control
from tests import netns
from workers import job
from workers.launcher import TrainConfig, evaluate

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces"),
    pytest.mark.slow,  # 17 to 100 s on a shared 2-core machine, by its load
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parents[1]
PORT = 6379
STEPS = 1500  # per worker, as W4
LOG_EVERY = 20
TARGET = 0.97  # W4's reference is 0.98; 2 x 1,500 steps reach 0.978 on one host
#: worker0's steps (and global steps) made while w1's link is down: a few seconds
OUTAGE_STEPS = 200


@dataclass
class Role:
    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def tail(self) -> str:
        text = self.err.read_text(errors="replace") if self.err.exists() else ""
        return f"--- {self.name} (exit {self.proc.poll()}):\n{text[-2500:]}"


@pytest.fixture
def network() -> Iterator[netns.Network]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"multi-host test needs network namespaces: {why}")
    with netns.Network(["server", "w0", "w1"]) as net:
        yield net


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # short: the unix socket's path must fit in 107 bytes
    path = Path(tempfile.mkdtemp(prefix="qpsmh", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def hosts(network: netns.Network, run_dir: Path) -> AsyncIterator[Hosts]:
    h = Hosts(network, run_dir)
    try:
        yield h
    finally:
        await h.stop()


class Hosts:
    """The processes started on the hosts, their logs, and a client on the server's
    unix socket (outside every network namespace)."""

    def __init__(self, net: netns.Network, run_dir: Path) -> None:
        self.net = net
        self.dir = run_dir
        self.socket = run_dir / "redis.sock"
        self.url = f"redis://{net.ip['server']}:{PORT}/0"
        self.roles: dict[str, Role] = {}
        self.client: qps.Client | None = None

    def start(self, name: str, host: str, *argv: str) -> Role:
        out, err = self.dir / f"{name}.out", self.dir / f"{name}.err"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env.pop("QPS_REDIS_URL", None)
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                self.net.argv(host, *argv), stdin=subprocess.DEVNULL, stdout=o, stderr=e, env=env
            )
        self.roles[name] = role = Role(name, proc, out, err)
        return role

    def start_qps(self, name: str, host: str, *args: str) -> Role:
        return self.start(name, host, sys.executable, "-m", "qps.cli.main", *args)

    async def start_redis(self) -> qps.Client:
        binary, _ = find_server_binary()
        self.start(
            "redis", "server", binary, "--bind", self.net.ip["server"], "--port", str(PORT),
            "--unixsocket", str(self.socket), "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.dir),
        )  # fmt: skip

        async def up() -> bool:
            try:
                self.client = await qps.connect(f"unix://{self.socket}")
            except QpsError:
                return False
            return True

        await self.until("Redis answers on its unix socket", up, timeout=20)
        assert self.client is not None
        return self.client

    def failed(self) -> str:
        """The logs of roles that exited with a non-zero status ("" if none did)."""
        return "\n".join(r.tail() for r in self.roles.values() if r.proc.poll() not in (None, 0))

    async def until(
        self,
        what: str,
        pred: Callable[[], Awaitable[bool]],
        timeout: float = 60,
        progress: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """Check ``pred`` every 100 ms until it holds; fail after ``timeout`` s, or at
        once when a role has failed. With ``progress`` (e.g. the global step), the
        ``timeout`` s count from its last change: a job that trains slowly on a busy
        machine is waited for, one that is stuck is not."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        last = None if progress is None else await progress()
        while not await pred():
            if bad := self.failed():
                raise AssertionError(f"a role failed while waiting for: {what}\n{bad}")
            if progress is not None and (now := await progress()) != last:
                last, end = now, loop.time() + timeout
            if loop.time() > end:
                logs = "\n".join(r.tail() for r in self.roles.values())
                quiet = "" if progress is None else " without progress"
                raise AssertionError(f"not within {timeout} s{quiet}: {what}\n{logs}")
            await asyncio.sleep(0.1)

    async def wait_exit(
        self,
        names: list[str],
        timeout: float = 60,
        progress: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        async def exited() -> bool:
            return all(self.roles[n].proc.poll() is not None for n in names)

        await self.until(f"{', '.join(names)} exit", exited, timeout, progress)

    async def stop(self) -> None:
        """SIGTERM what still runs (the roles handle it), SIGKILL it after 10 s."""
        for r in self.roles.values():
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.roles.values():
            try:
                await asyncio.to_thread(r.proc.wait, 10)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        if self.client is not None:
            await self.client.close()


async def test_training_across_hosts_survives_a_cut_link(hosts: Hosts) -> None:
    net, c = hosts.net, f"mh-{secrets.token_hex(3)}"
    client = await hosts.start_redis()
    common = ["--url", hosts.url, "--container", c]
    for i in range(2):
        hosts.start_qps(f"ps{i}", "server", "ps", "--shard", str(i), "--num-shards", "2",
                        "--optimizer", "sgd", "--lr", "0.05", "--max-group", "8", *common)  # fmt: skip
    for k in range(2):
        hosts.start_qps(f"w{k}", f"w{k}", "worker", "--index", str(k), "--num-workers", "2",
                        "--num-shards", "2", "--steps", str(STEPS),
                        "--log-every", str(LOG_EVERY), "--json", *common)  # fmt: skip

    async def step_of(worker: str) -> int:
        return int((await job.read_statuses(client, c)).get(worker, {}).get("step", 0))

    async def global_step() -> int:
        return await control.global_step_counter(client, c).get()

    async def both_training() -> bool:
        return min(await step_of("worker0"), await step_of("worker1")) >= 2 * LOG_EVERY

    await hosts.until("both workers are training", both_training, timeout=120)
    net.cut("w1")
    assert not net.link_up("w1")
    w0_cut, g_cut = await step_of("worker0"), await global_step()

    async def worker0_published() -> bool:
        return await step_of("worker0") > w0_cut

    # by the time worker0 has published again, what w1 sent before the cut has arrived
    await hosts.until("worker0 publishes its status after the cut", worker0_published)
    w1_cut = await step_of("worker1")
    assert w1_cut < STEPS - 5 * LOG_EVERY, "w1 was nearly done before its link was cut"

    async def training_goes_on() -> bool:
        # the global step counts applied gradients: w1 may have left a few in the
        # shards' queues (8 each at most), the rest are worker0's
        w0, g = await step_of("worker0"), await global_step()
        return w0 >= w0_cut + OUTAGE_STEPS and g >= g_cut + OUTAGE_STEPS

    await hosts.until(
        "the global step advances while w1 is cut off", training_goes_on, progress=global_step
    )
    assert await step_of("worker1") == w1_cut  # nothing of w1 reached Redis meanwhile
    assert not net.link_up("w1") and hosts.roles["w1"].proc.poll() is None  # w1 waits
    net.restore("w1")

    async def rejoined() -> bool:
        return await step_of("worker1") > w1_cut

    await hosts.until("worker1 carries on once its link is back", rejoined)
    await hosts.wait_exit(["w0", "w1", "ps0", "ps1"], timeout=90, progress=global_step)
    for name in ("ps0", "ps1", "w0", "w1"):
        role = hosts.roles[name]
        assert role.proc.returncode == 0, role.tail()
    assert await control.is_finished(client, c)
    for name in ("w0", "w1"):
        result = json.loads(hosts.roles[name].out.read_text())
        assert result["steps"] == STEPS and result["stopped_by"] == f"{STEPS} steps", result
    assert await global_step() == 2 * STEPS  # every push applied exactly once
    got = await evaluate(client, c, TrainConfig(num_shards=2, num_workers=2))
    assert got is not None and got[0] == "accuracy"
    assert got[1] >= TARGET, got
