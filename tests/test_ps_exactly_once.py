"""Exactly-once gradient application across SIGKILLs of the PS shard (and a Redis
restart with AOF), with real processes on a real server (docs/ps.md, "Exactly once").

Four worker processes push SGD gradients of known small integer values (float64, so
every sum is exact) while the shard process (``qps ps``) is SIGKILLed five times at
moments picked from the progress of training, and restarted. Some of those kills are
placed where redelivery is certain: the shard is replaced by one that SIGKILLs itself
after committing a group of messages and before acknowledging it, so the next shard gets
messages back that every variable has applied already and must skip. The Redis restart
variant restarts the server while such a group is committed and unacknowledged. At the
end each variable must equal the exact expected sum, its version must equal the number
of messages (nothing lost, nothing applied twice), and the shards' logs must show the
redelivered messages skipped: at least as many as the crashed shards committed.

``QPS_TEST_PS_PUSHES`` sets the total number of pushes (default 10,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
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
from tests.conftest import within
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
        self.starts = 0  # shard runs, crashing ones included: run i logs to shard{i}.log
        self.crashed: list[int] = []  # per crash before an ack: the group's size

    def _log(self, run: int) -> str:
        return os.path.join(self.log_dir, f"shard{run}.log")

    async def _spawn(self, *args: str) -> asyncio.subprocess.Process:
        self.starts += 1
        with open(self._log(self.starts), "wb") as log:
            return await asyncio.create_subprocess_exec(
                sys.executable, *args, env=self.env, stderr=log, stdout=log
            )

    async def start_shard(self) -> None:
        self.shard = await self._spawn(
            "-m", "qps.cli.main", "ps", "--shard", "0", "--num-shards", "1",
            "--url", self.url, "--container", C, "--lease-ms", "1000",
        )  # fmt: skip

    async def kill_shard(self) -> None:
        assert self.shard is not None
        if self.shard.returncode is None:
            os.kill(self.shard.pid, signal.SIGKILL)
        await self.shard.wait()

    async def crash_before_ack(self) -> None:
        """Run a shard that SIGKILLs itself once it has committed a group of messages
        and before it acknowledges them: every variable has applied them, and their
        deliveries come back to the next shard (tests/ps_worker.py --crash-shard)."""
        proc = await self._spawn(
            os.path.join(REPO, "tests", "ps_worker.py"), "--crash-shard", self.url, C,
            "before-ack",
        )  # fmt: skip
        what = "a crashing shard commits a group and kills itself before the ack"
        code = await within(proc.wait(), 120, what)
        text = self.text(self.starts)
        found = re.search(r"killing myself before-ack a group of (\d+) message", text)
        assert code == -signal.SIGKILL and found, f"{what}: exit {code}\n{text[-3000:]}"
        self.crashed.append(int(found[1]))

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

    def text(self, run: int) -> str:
        with open(self._log(run), "rb") as f:
            return f.read().decode(errors="replace")

    def skipped(self, runs: range) -> int:
        """Redelivered messages the shard runs ``runs`` found applied and skipped."""
        return sum(
            t.count("was applied before") + t.count("partly applied")
            for t in (self.text(i) for i in runs)
        )

    def logs(self, lines: int = 15) -> str:
        out = []
        for i in range(1, self.starts + 1):
            tail = self.text(i).splitlines()[-lines:]
            out.append(f"--- shard run {i} ---\n" + "\n".join(tail))
        return "\n".join(out)

    async def check_shard(self) -> None:
        """Restart a shard that lost its lease (a stall of a loaded machine); any other
        exit of a shard by itself fails the test at once, with its log."""
        assert self.shard is not None
        if self.shard.returncode is None:
            return
        if self.shard.returncode == 1 and "lease lost" in self.text(self.starts):
            await self.start_shard()
            return
        raise AssertionError(
            f"shard run {self.starts} exited {self.shard.returncode} by itself while the "
            f"job ran\n{self.logs(40)}"
        )


async def _global_step(client: qps.Client) -> int:
    return await control.global_step_counter(client, C).get()


async def _wait_steps(job: Job, client: qps.Client, n: int, timeout: float) -> None:
    """Wait until the global step reaches ``n``, checking the shard meanwhile."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while await _global_step(client) < n:
        await job.check_shard()
        if loop.time() > end:
            raise AssertionError(
                f"the global step did not reach {n} in {timeout:g} s "
                f"(at {await _global_step(client)})\n{job.logs()}"
            )
        await asyncio.sleep(0.05)


async def _workers_done(job: Job, procs: list[asyncio.subprocess.Process]) -> None:
    for k, p in enumerate(procs):
        code = await within(p.wait(), 300, f"worker {k} pushes all its steps and exits")
        assert code == 0, f"worker {k} exited {code}\n{job.logs()}"


async def _phase(
    job: Job,
    client: qps.Client,
    first: int,
    count: int,
    kills: int,
    crashes: set[int],
    rng: random.Random,
) -> None:
    """Workers push steps first..first+count-1 while the shard is killed ``kills`` times:
    kill ``k`` is a crash between a group's commit and its ack if ``k`` is in
    ``crashes``, else a SIGKILL at a random moment."""
    base = await _global_step(client)
    total = WORKERS * count
    procs = await job.workers(first, count)
    try:
        for k in range(kills):
            await _wait_steps(job, client, base + total * (k + 1) // (kills + 1), 300)
            await asyncio.sleep(rng.random() * 0.2)  # a random moment of an apply
            await job.kill_shard()
            if k in crashes:
                await job.crash_before_ack()
            await job.start_shard()
        await _workers_done(job, procs)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()


BURST = 10  # steps per worker pushed while no shard runs (the Redis restart variant)


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
        # room for a burst of WORKERS * BURST messages queued with no shard running
        await control.configure(client, C, 1, SGD(learning_rate=1.0), queue_capacity=64)
        async with qps.Session(client=client, container=C) as sess:
            await sess.variable("w", (4,), np.float64, initializer="zeros").create()
            await sess.variable("emb", (ROWS, 2), np.float64, initializer="zeros").create()
        await control.place_variables(client, C, ["w", "emb"])
        await job.start_shard()
        if not redis_restart:
            await _phase(job, client, 0, steps, KILLS, {1, 3}, rng)
            assert len(job.crashed) == 2
            after = range(1, job.starts + 1)
        else:
            half = steps // 2
            await _phase(job, client, 0, half, KILLS // 2, {1}, rng)
            # Redis restarts while a group is committed and not acknowledged: with no
            # shard running, a burst of messages is queued, a crashing shard commits a
            # group of them and dies before its ack, then the server restarts (SHUTDOWN
            # fsyncs the AOF) and the next shard gets them back
            await job.kill_shard()
            await _workers_done(job, await job.workers(half, BURST))
            await job.crash_before_ack()
            restarted = job.starts + 1
            await client.close()
            server.stop()
            server.start()
            client = await qps.connect(server.url)
            await job.start_shard()
            rest = steps - half - BURST
            await _phase(job, client, half + BURST, rest, KILLS - KILLS // 2, set(), rng)
            assert len(job.crashed) == 2
            after = range(restarted, job.starts + 1)
        await _wait_steps(job, client, WORKERS * steps, 300)
        await control.mark_finished(client, C)
        assert job.shard is not None
        code = await within(job.shard.wait(), 60, "the shard drains the finished job and exits")
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
        assert job.starts >= KILLS + 1 + len(job.crashed)
        # the redelivery path was taken: every message a crashed shard committed came
        # back and was skipped (after the restart, in the Redis restart variant)
        skipped, committed = job.skipped(after), job.crashed[-1 if redis_restart else 0 :]
        print(f"{job.starts} shard runs; crashed groups {job.crashed}; skipped {skipped}")
        assert skipped >= sum(committed) > 0, job.logs()
        # ids of acknowledged messages are released (a kill between ack and release
        # may leave one group's per kill; they expire)
        left = await client.commands.zcard(keys.variable_applied(C, "w"))
        assert left <= job.starts * DEFAULT_MAX_GROUP
    finally:
        if job.shard is not None and job.shard.returncode is None:
            job.shard.kill()
            await job.shard.wait()
        await client.close()
