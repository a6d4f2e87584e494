"""Processes killed with SIGKILL in the middle of a queue operation (real server only).

Their attempts are undone once their lease runs out (docs/queues.md, "Acknowledged dequeues"): elements a
dead consumer had collected go back to the front in order, and a dead producer's
not-yet-inserted elements are dropped, so nobody behind it waits forever.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import qps
from tests.conftest import until

CHILD = """
import asyncio, sys, numpy as np, qps
async def main(url, op):
    async with await qps.connect(url) as c:
        q = qps.FIFOQueue(2, np.int64, shapes=[[]], shared_name="crash", client=c)
        if op == "dequeue_many":
            await q.dequeue_many(3)
        else:
            await q.enqueue_many(np.array([30, 40], np.int64))
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def _spawn(url: str, op: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "QPS_LEASE_MS": "3000", "PYTHONPATH": str(Path(__file__).parents[1])}
    return await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, url, op, env=env)


@pytest.mark.slow
async def test_killed_consumer_gives_back_what_it_held(redis_url):
    async with await qps.connect(redis_url) as client:
        await qps.queues.delete_queue(client, "crash")
        q = qps.FIFOQueue(2, np.int64, shapes=[[]], shared_name="crash", client=client)
        await q.enqueue_many(np.array([1, 2], np.int64))
        child = await _spawn(redis_url, "dequeue_many")
        try:
            await until(lambda: _held(q, 2), timeout=30)
            assert await q.size() == 0
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            # Queued behind the dead attempt; its lease runs out and its elements come back.
            assert (await q.dequeue_many(2, timeout=30)).tolist() == [1, 2]
        finally:
            if child.returncode is None:
                child.kill()
        s = await q.stats()
        assert (s.size, s.held, s.pending_dequeues, s.dequeued_total) == (0, 0, 0, 2)
        await qps.queues.delete_queue(client, "crash")


@pytest.mark.slow
async def test_killed_producer_does_not_block_the_queue(redis_url):
    async with await qps.connect(redis_url) as client:
        await qps.queues.delete_queue(client, "crash")
        q = qps.FIFOQueue(2, np.int64, shapes=[[]], shared_name="crash", client=client)
        await q.enqueue_many(np.array([1, 2], np.int64))  # full
        child = await _spawn(redis_url, "enqueue_many")
        try:
            await until(lambda: _pending_enq(q), timeout=30)
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            # A plain close queues behind the dead producer's enqueue; once that is undone
            # the close applies, and the dead producer's elements were never inserted.
            await q.close(timeout=30)
        finally:
            if child.returncode is None:
                child.kill()
        assert await q.is_closed()
        assert (await q.dequeue_up_to(10)).tolist() == [1, 2]
        s = await q.stats()
        assert (s.pending_enqueues, s.enqueued_total) == (0, 2)
        await qps.queues.delete_queue(client, "crash")


async def _held(q, n):
    s = await q.stats()
    return s.pending_dequeues == 1 and s.held == n


async def _pending_enq(q):
    return (await q.stats()).pending_enqueues == 1
