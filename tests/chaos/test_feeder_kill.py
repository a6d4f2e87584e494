"""A feeder (``qps feed``) SIGKILLed while its enqueue waits for room, restarted with the
same command (and no seed: the first run drew one and recorded it), several times: the
consumer still gets every input example exactly once per epoch, the last feeder exits 0
and closes the queue, and the container reset leaves no key."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import OutOfRangeError
from qps.queues import queue_stats
from tests.conftest import until
from workers.feeder import counter_names

ROOT = Path(__file__).resolve().parents[2]
N, EPOCHS, CAPACITY = 200, 3, 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_feeder_resumes_and_feeds_each_example_once_per_epoch(
    redis_url: str, tmp_path: Path
) -> None:
    data = tmp_path / "ids.npz"
    np.savez(data, x=np.arange(N, dtype=np.float32)[:, None], y=np.arange(N, dtype=np.int64))
    container = f"feedkill-{secrets.token_hex(3)}"
    cmd = [sys.executable, "-m", "qps.cli.main", "feed", "--data", str(data), "--x-key", "x",
           "--y-key", "y", "--epochs", str(EPOCHS), "--batch-size", "16", "--capacity",
           str(CAPACITY), "--queue", "input", "--url", redis_url, "--container", container]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[str]] = []

    def start() -> subprocess.Popen[str]:
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        procs.append(p)
        return p

    async def main() -> tuple[list[int], str]:
        c = await qps.connect(redis_url)
        try:
            q = qps.FIFOQueue(
                CAPACITY, [np.float32, np.int64], [[1], []], shared_name="input",
                container=container, client=c,
            )  # fmt: skip
            got: list[int] = []

            async def take(upto: int) -> None:
                while len(got) < upto:
                    x, y = await q.dequeue_up_to(min(8, upto - len(got)))
                    assert [int(v) for v in x[:, 0]] == [int(v) for v in y]
                    got.extend(int(v) for v in y)

            async def waits_for_room() -> bool:
                s = await queue_stats(c, "input", container)
                return s.size >= CAPACITY and s.pending_enqueues == 1

            state = keys.feed_prefix(container, "input") + "state"

            async def feeder() -> bytes | None:
                return await c.commands.hget(state, "client")  # type: ignore[no-any-return]

            p = start()
            for kill_at in (40, 250, 430):  # in epochs 1, 2 and 3
                await take(kill_at)
                await until(waits_for_room, timeout=60)
                dead = await feeder()
                p.kill()
                p.wait()
                p = start()

                async def resumed(dead: bytes | None = dead) -> bool:
                    return await feeder() not in (None, dead)

                # consume nothing until the new feeder has planned its resume: the dead
                # one's waiting rest must not slip in after that (it is undone)
                await until(resumed, timeout=60)
            while True:
                try:
                    await take(len(got) + 8)
                except OutOfRangeError:
                    break
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
            s = await queue_stats(c, "input", container)
            assert s.closed and s.size == 0 and s.enqueued_total == N * EPOCHS
            ex, ep = counter_names("input")
            counts = [await qps.Counter(n, container=container, client=c).get() for n in (ex, ep)]
            assert counts == [N * EPOCHS, EPOCHS]
            await qps.reset(client=c, containers=[container])
            left = [k async for k in c.commands.scan_iter(match=f"*{{{container}*")]
            assert left == []
            return got, out
        finally:
            await c.close()

    try:
        got, out = asyncio.run(main())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert "took over the feed" in out and "resuming the feed" in out
    assert len(got) == N * EPOCHS
    for e in range(EPOCHS):  # every example once per epoch, epochs in order
        assert sorted(got[e * N : (e + 1) * N]) == list(range(N)), e
    assert all(p.returncode is not None for p in procs)  # no process left
