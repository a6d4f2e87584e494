"""Many producer and consumer processes on one queue (real server only).

8 producers and 8 consumers move 200,000 elements through a capacity-100 queue: every
element is delivered exactly once, the size never exceeds the capacity, and (FIFO) each
producer's elements reach every consumer in the order they were produced.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import qps

WORKER = str(Path(__file__).with_name("mp_queue_worker.py"))
TOTAL = 200_000
PRODUCERS = CONSUMERS = 8


async def exited(q, procs, what: str, quiet: float = 120.0) -> list[int]:
    """Wait for ``procs`` to exit while the queue makes progress (its enqueued and
    dequeued totals move); fail once neither has moved for ``quiet`` seconds. A busy
    machine makes the run slower, not stuck."""
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    last, still = None, 0.0
    while True:
        done, _ = await asyncio.wait(waits, timeout=5)
        if len(done) == len(waits):
            return [w.result() for w in waits]
        s = await q.stats()
        now = (s.enqueued_total, s.dequeued_total)
        still = still + 5 if now == last else 0.0
        last = now
        assert still < quiet, f"{what}: no progress in {quiet:g} s at {now}"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 200,000 elements through 16 processes, beside CPU hogs
@pytest.mark.parametrize("kind", ["fifo", "shuffle"])
async def test_many_processes_exactly_once(redis_url, tmp_path, kind):
    name = f"mp-{kind}-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    async with await qps.connect(redis_url) as client:
        from tests.mp_queue_worker import make_queue

        q = make_queue(kind, name, client)
        await qps.queues.delete_queue(client, name)
        await q.size()  # creates it
        per = TOTAL // PRODUCERS
        producers = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                WORKER,
                "produce",
                redis_url,
                kind,
                name,
                str(i * per),
                str(per),
                str(100 + i),
                env=env,
            )
            for i in range(PRODUCERS)
        ]
        outs = [tmp_path / f"c{i}.npy" for i in range(CONSUMERS)]
        consumers = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                WORKER,
                "consume",
                redis_url,
                kind,
                name,
                str(outs[i]),
                str(200 + i),
                env=env,
            )
            for i in range(CONSUMERS)
        ]
        max_seen = 0

        async def monitor() -> None:
            nonlocal max_seen
            while True:
                max_seen = max(max_seen, await q.size())
                await asyncio.sleep(0.005)

        mon = asyncio.create_task(monitor())
        try:
            assert await exited(q, producers, "the producers") == [0] * PRODUCERS
            await q.close()
            assert await exited(q, consumers, "the consumers") == [0] * CONSUMERS
        finally:
            mon.cancel()
            for p in producers + consumers:
                if p.returncode is None:
                    p.kill()
        stats = await q.stats()
        assert int(await client.commands.hget(q._keys[0], "w")) == await client.commands.zcard(
            q._keys[4]
        )
        await qps.queues.delete_queue(client, name)
    received = [np.load(o) for o in outs]
    allids = np.concatenate(received)
    assert len(allids) == TOTAL
    assert np.array_equal(np.sort(allids), np.arange(TOTAL))  # exactly once
    assert 0 < max_seen <= 100
    assert stats.enqueued_total == TOTAL and stats.dequeued_total == TOTAL and stats.size == 0
    if kind == "fifo":
        for ids in received:  # per producer, a consumer sees increasing ids
            for p in range(PRODUCERS):
                mine = ids[(ids >= p * per) & (ids < (p + 1) * per)]
                assert np.all(np.diff(mine) > 0)
    else:
        assert sum(1 for ids in received if np.any(np.diff(ids) < 0)) > 0  # really shuffled
