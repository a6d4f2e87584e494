"""RandomShuffleQueue: docs/queues.md and conformance cases 33-39."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qps
from qps.errors import DeadlineExceededError, InvalidArgumentError, OutOfRangeError
from tests.conftest import until

I32 = np.int32


def rsq(client, capacity=10, min_after=0, **kw):
    return qps.RandomShuffleQueue(capacity, min_after, I32, shapes=[[]], client=client, **kw)


async def test_33_min_after_dequeue_blocks(client):
    q = rsq(client, 10, 2)
    await q.enqueue_many(np.array([1, 2, 3], I32))
    await q.dequeue()
    with pytest.raises(DeadlineExceededError):
        await q.dequeue(timeout=0.2)
    assert await q.size() == 2


async def test_34_close_lifts_min_after_dequeue(client):
    q = rsq(client, 10, 5)
    await q.enqueue_many(np.array([1, 2, 3], I32))
    await q.close()
    a = await q.dequeue_many(2)
    b = await q.dequeue()
    assert sorted([*a.tolist(), int(b)]) == [1, 2, 3]
    with pytest.raises(OutOfRangeError):
        await q.dequeue_many(2)


async def test_35_pending_dequeue_many_completes_on_close(client):
    q = rsq(client, 10, 5)
    await q.enqueue_many(np.array([1, 2, 3], I32))
    task = asyncio.create_task(q.dequeue_many(2))
    await until(lambda: _pending_deq(q))
    await q.close()
    out = await task
    assert len(out) == 2 and set(out.tolist()) <= {1, 2, 3}
    assert await q.size() == 1


def test_36_min_after_dequeue_below_capacity():
    with pytest.raises(InvalidArgumentError, match="min_after_dequeue 5 must be < capacity 5"):
        qps.RandomShuffleQueue(5, 5, I32)
    qps.RandomShuffleQueue(5, 4, I32)


async def _drain_order(client, name, seed):
    q = qps.RandomShuffleQueue(20, 0, I32, shapes=[[]], seed=seed, shared_name=name, client=client)
    await q.enqueue_many(np.arange(10, dtype=I32))
    await q.close()
    return [int(x) for x in await q.dequeue_up_to(10)]


async def test_37_seeded_order_is_reproducible(make_client):
    a = await make_client()
    b = await make_client()
    first = await _drain_order(a, "s1", seed=7)
    second = await _drain_order(b, "s2", seed=7)  # another client, a fresh queue
    assert first == second
    assert sorted(first) == list(range(10))
    assert first != list(range(10))
    unseeded = [await _drain_order(a, f"u{i}", seed=None) for i in range(3)]
    assert len({tuple(o) for o in unseeded}) > 1  # 3 equal random permutations: p ~ 1e-13
    assert await _drain_order(a, "s3", seed=8) != first


async def test_37b_seeded_order_with_interleaved_operations(client):
    async def run(name):
        q = qps.RandomShuffleQueue(
            50, 2, I32, shapes=[[]], seed=11, shared_name=name, client=client
        )
        out = []
        for i in range(0, 40, 4):
            await q.enqueue_many(np.arange(i, i + 4, dtype=I32))
            out += (await q.dequeue_many(2)).tolist()
        await q.close()
        out += (await q.dequeue_up_to(100)).tolist()
        return out

    a, b = await run("i1"), await run("i2")
    assert a == b and sorted(a) == list(range(40))


async def test_38_restore_on_close(client):
    q = rsq(client, 10, 0)
    await q.enqueue_many(np.array([1, 2], I32))
    task = asyncio.create_task(q.dequeue_many(3))
    await until(lambda: _pending_deq(q))
    await q.close()
    with pytest.raises(OutOfRangeError):
        await task
    assert await q.size() == 2
    assert sorted((await q.dequeue_up_to(3)).tolist()) == [1, 2]


async def test_39_every_element_exactly_once(client):
    q = rsq(client, 1000, 10, seed=3)
    values = np.arange(500, dtype=I32)
    producer = asyncio.create_task(q.enqueue_many(values))
    got = []
    while len(got) < 490:
        got += (await q.dequeue_many(10, timeout=10)).tolist()
    await producer
    await q.close()
    got += (await q.dequeue_up_to(100)).tolist()
    assert sorted(got) == values.tolist()


async def test_dequeue_up_to_respects_min_after_dequeue_while_open(client):
    q = rsq(client, 10, 2)
    await q.enqueue_many(np.array([1, 2, 3, 4], I32))
    task = asyncio.create_task(q.dequeue_up_to(5))
    await until(lambda: _held(q, 2))
    assert await q.size() == 2
    await q.close()  # lifts min_after_dequeue: the pending call collects the last 2 too
    assert sorted((await task).tolist()) == [1, 2, 3, 4]
    assert await q.size() == 0


async def _pending_deq(q):
    return (await q.stats()).pending_dequeues == 1


async def _held(q, n):
    s = await q.stats()
    return s.pending_dequeues == 1 and s.held == n
