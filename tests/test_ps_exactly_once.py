"""Exactly-once gradient application across SIGKILLs of the PS shard (and a Redis
restart with AOF), with real processes on a real server (DESIGN.md §4.7).

Four worker processes push SGD gradients of known small integer values (float64, so
every sum is exact) while the shard process (``qps ps``) is SIGKILLed five times at
moments picked from the progress of training, and restarted. At the end each variable
must equal the exact expected sum, and its version must equal the number of messages:
nothing lost, nothing applied twice.

``QPS_TEST_PS_PUSHES`` sets the total number of pushes (default 10,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import qps
from qps import keys
from qps.embedded import EmbeddedServer
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.shard import DEFAULT_MAX_GROUP
from tests.ps_worker import ROWS, expected

REPO = str(Path(__file__).resolve().parents[1])
PUSHES = int(os.environ.get("QPS_TEST_PS_PUSHES", "10000"))
WORKERS = 4
KILLS = 5
C = "eo"


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    run_dir = tempfile.mkdtemp(prefix="qpsps", dir="/tmp")
    srv = EmbeddedServer(run_dir=run_dir)  # AOF on, appendfsync everysec
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


class Job:
    def __init__(self, url: str, log_dir: str) -> None:
        self.url = url
        self.log_dir = log_dir
        self.env = {**os.environ, "QPS_LEASE_MS": "3000", "PYTHONPATH": REPO}
        self.shard: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start_shard(self) -> None:
        self.starts += 1
        log = open(os.path.join(self.log_dir, f"shard{self.starts}.log"), "wb")  # noqa: SIM115
        self.shard = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "qps.cli.main", "ps", "--shard", "0", "--num-shards", "1",
            "--url", self.url, "--container", C, "--lease-ms", "1000",
            env=self.env, stderr=log, stdout=log,
        )  # fmt: skip
        log.close()

    async def kill_shard(self) -> None:
        assert self.shard is not None
        if self.shard.returncode is None:
            os.kill(self.shard.pid, signal.SIGKILL)
        await self.shard.wait()

    async def workers(self, first: int, count: int) -> list[asyncio.subprocess.Process]:
        return [
            await asyncio.create_subprocess_exec(
                sys.executable,
                os.path.join(REPO, "tests", "ps_worker.py"),
                self.url,
                C,
                str(k),
                str(first),
                str(count),
                env=self.env,
            )
            for k in range(WORKERS)
        ]

    def logs(self, lines: int = 15) -> str:
        out = []
        for i in range(1, self.starts + 1):
            with open(os.path.join(self.log_dir, f"shard{i}.log"), "rb") as f:
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
            out.append(f"--- shard run {i} ---\n" + "\n".join(tail))
        return "\n".join(out)


async def _global_step(client: qps.Client) -> int:
    return await control.global_step_counter(client, C).get()


async def _wait_steps(job: Job, client: qps.Client, n: int, timeout: float) -> None:
    """Wait until the global step reaches ``n``; restart the shard if it died."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while await _global_step(client) < n:
        assert job.shard is not None
        if job.shard.returncode is not None:
            await job.start_shard()
        if loop.time() > end:
            raise AssertionError(f"global step {await _global_step(client)} < {n}\n{job.logs()}")
        await asyncio.sleep(0.05)


async def _phase(
    job: Job, client: qps.Client, first: int, count: int, kills: int, rng: random.Random
) -> None:
    """Workers push steps first..first+count-1 while the shard is killed ``kills`` times."""
    base = await _global_step(client)
    total = WORKERS * count
    procs = await job.workers(first, count)
    try:
        for k in range(kills):
            await _wait_steps(job, client, base + total * (k + 1) // (kills + 1), 300)
            await asyncio.sleep(rng.random() * 0.2)  # a random moment of an apply
            await job.kill_shard()
            await job.start_shard()
        for p in procs:
            assert await asyncio.wait_for(p.wait(), 300) == 0
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("redis_restart", [False, True], ids=["sigkill", "sigkill+redis-restart"])
async def test_every_gradient_applied_exactly_once(
    server: EmbeddedServer, redis_restart: bool
) -> None:
    rng = random.Random(7 + redis_restart)
    steps = PUSHES // WORKERS
    job = Job(server.url, server.run_dir)
    client = await qps.connect(server.url)
    try:
        await control.configure(client, C, 1, SGD(learning_rate=1.0))
        async with qps.Session(client=client, container=C) as sess:
            await sess.variable("w", (4,), np.float64, initializer="zeros").create()
            await sess.variable("emb", (ROWS, 2), np.float64, initializer="zeros").create()
        await control.place_variables(client, C, ["w", "emb"])
        await job.start_shard()
        if not redis_restart:
            await _phase(job, client, 0, steps, KILLS, rng)
        else:
            half = steps // 2
            await _phase(job, client, 0, half, KILLS // 2, rng)
            # the workers are done with the first half; the shard is still applying
            # its backlog: restart the server under it (SHUTDOWN fsyncs the AOF)
            await client.close()
            server.stop()
            server.start()
            client = await qps.connect(server.url)
            await _phase(job, client, half, steps - half, KILLS - KILLS // 2, rng)
        await _wait_steps(job, client, WORKERS * steps, 300)
        await control.mark_finished(client, C)
        assert job.shard is not None
        code = await asyncio.wait_for(job.shard.wait(), 60)
        assert code == 0, job.logs()

        want_w, want_emb = expected(WORKERS, steps)
        w = await qps.variables.open_variable(client, "w", C)
        emb = await qps.variables.open_variable(client, "emb", C)
        got_w, got_emb = await w.read(), await emb.read()
        np.testing.assert_array_equal(got_w.value, want_w)
        np.testing.assert_array_equal(got_emb.value, want_emb)
        # one version per message: nothing applied twice, nothing lost
        assert got_w.version == got_emb.version == WORKERS * steps
        assert await _global_step(client) == WORKERS * steps
        assert await control.dead_letters(client, C, 0) == []
        st = await control.shard_status(client, C, 0)
        assert st.state == "finished" and st.queue_size == 0
        assert job.starts >= KILLS + 1
        logs = job.logs(lines=0)
        print(
            f"{job.starts} shard runs; redeliveries skipped whole: "
            f"{logs.count('was applied before')}, in part: {logs.count('partly applied')}"
        )
        # ids of acknowledged messages are released (a kill between ack and release
        # may leave one group's per kill; they expire)
        left = await client.commands.zcard(keys.variable_applied(C, "w"))
        assert left <= job.starts * DEFAULT_MAX_GROUP
    finally:
        if job.shard is not None and job.shard.returncode is None:
            job.shard.kill()
            await job.shard.wait()
        await client.close()
