"""PriorityQueue: docs/queues.md and conformance cases 44-45."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qps
from qps import keys, wire
from qps.errors import CancelledError, InvalidArgumentError, OutOfRangeError
from qps.queues.priority import priority_keys
from tests.conftest import until


def prioq(client, capacity=10, **kw):
    return qps.PriorityQueue(capacity, [np.int32], shapes=[[]], client=client, **kw)


async def test_44_dequeue_in_ascending_priority_with_priority_as_component_0(client):
    q = prioq(client)
    for i, p in enumerate([5, 1, 3, 1, -2]):
        await q.enqueue((p, 10 * i))
    out = [await q.dequeue() for _ in range(5)]
    assert [int(p) for p, _ in out] == [-2, 1, 1, 3, 5]
    assert all(p.dtype == np.int64 and p.shape == () for p, _ in out)
    # equal priorities leave in insertion order (TF leaves that order unspecified)
    assert [int(v) for _, v in out] == [40, 10, 30, 20, 0]


async def test_45_enqueue_many_then_dequeue_many(client):
    q = prioq(client)
    await q.enqueue_many((np.array([3, 1, 2, 1]), np.array([30, 10, 20, 11], np.int32)))
    prios, vals = await q.dequeue_many(4)
    assert prios.tolist() == [1, 1, 2, 3] and prios.dtype == np.int64
    assert vals.tolist() == [10, 11, 20, 30]


async def test_45_priority_must_be_int64(client):
    q = prioq(client)
    with pytest.raises(ValueError, match="expected int64, got int32"):
        await q.enqueue((np.int32(1), 5))
    with pytest.raises(ValueError, match="expected int64"):
        await q.enqueue_many((np.array([1, 2], np.int32), np.array([1, 2], np.int32)))
    with pytest.raises(InvalidArgumentError):
        await q.enqueue((1.5, 5))
    assert await q.size() == 0


def test_shapes_are_required():
    with pytest.raises(TypeError):
        qps.PriorityQueue(10, [np.int32], None)
    with pytest.raises(InvalidArgumentError, match="fully defined"):
        qps.PriorityQueue(10, [np.int32], [[None]])


def test_priority_keys_sort_like_the_numbers():
    prios = np.array([0, -1, 1, -(2**63), 2**63 - 1, 7, -7, 255, 256], np.int64)
    ordered = sorted(zip(priority_keys(prios), prios.tolist()))
    assert [p for _, p in ordered] == sorted(prios.tolist())


async def test_extreme_priorities_and_the_dtype_spec(client):
    q = prioq(client)
    assert q.dtypes == [np.dtype(np.int64), np.dtype(np.int32)]
    assert q.shapes == [(), ()]
    for p in [2**63 - 1, 0, -(2**63), -1]:
        await q.enqueue((p, 1))
    prios, _ = await q.dequeue_many(4)
    assert prios.tolist() == [-(2**63), -1, 0, 2**63 - 1]


async def test_blocking_capacity_and_close(client):
    q = prioq(client, capacity=2)
    await q.enqueue((5, 1))
    await q.enqueue((4, 2))
    blocked = asyncio.create_task(q.enqueue((1, 3)))
    await until(lambda: _pending_enqueues(q, 1))
    assert not blocked.done()
    assert [int(x) for x in await q.dequeue()] == [4, 2]  # room: the pending one goes in
    await blocked
    await q.close()
    with pytest.raises(CancelledError, match="is closed"):
        await q.enqueue((0, 0))
    prios, vals = await q.dequeue_up_to(5)
    assert prios.tolist() == [1, 5] and vals.tolist() == [3, 1]
    with pytest.raises(OutOfRangeError):
        await q.dequeue()


async def test_blocked_dequeue_wakes_on_enqueue(make_client):
    a, b = await make_client(), await make_client()
    qa = qps.PriorityQueue(10, [np.float32], [[2]], shared_name="p", client=a)
    qb = qps.PriorityQueue(10, [np.float32], [[2]], shared_name="p", client=b)
    task = asyncio.create_task(qa.dequeue_many(2))
    await until(lambda: _pending_dequeues(qb, 1))
    await qb.enqueue((9, np.ones(2, np.float32)))
    await qb.enqueue((-9, np.zeros(2, np.float32)))
    prios, vals = await asyncio.wait_for(task, 30)
    # the first element was taken when it arrived; the order is that of arrival to the
    # waiting dequeue, each element still carrying its priority
    assert sorted(prios.tolist()) == [-9, 9]
    assert vals.shape == (2, 2)


async def test_cancelled_dequeue_many_gives_elements_back_in_place(client):
    q = prioq(client)
    await q.enqueue((2, 20))
    await q.enqueue((1, 10))
    with pytest.raises(qps.errors.DeadlineExceededError):
        await q.dequeue_many(3, timeout=0.2)
    assert await q.size() == 2
    await q.enqueue((1, 11))
    prios, vals = await q.dequeue_many(3)
    assert prios.tolist() == [1, 1, 2] and vals.tolist() == [10, 11, 20]


async def test_names_include_the_priority(client):
    q = qps.PriorityQueue(
        5, [np.float32], [[]], names=["prio", "x"], shared_name="named", client=client
    )
    await q.enqueue({"prio": 3, "x": 1.5})
    await q.enqueue({"prio": -3, "x": 2.5})
    got = await q.dequeue()
    assert set(got) == {"prio", "x"} and int(got["prio"]) == -3 and float(got["x"]) == 2.5


async def test_shared_spec_mismatch(client):
    prioq(client, shared_name="s")
    await prioq(client, shared_name="s").size()
    with pytest.raises(InvalidArgumentError, match="capacity"):
        await prioq(client, capacity=3, shared_name="s").size()
    with pytest.raises(InvalidArgumentError, match="expected FIFOQueue, found PriorityQueue"):
        await qps.FIFOQueue(10, [np.int64, np.int32], client=client, shared_name="s").size()


async def test_peek_stats_and_large_elements(client):
    from qps.queues.large import CHUNK_BYTES

    n = CHUNK_BYTES // 2 + 10  # just over a chunk of float32: stored out of line
    q = qps.PriorityQueue(4, [np.float32], [[n]], shared_name="big", client=client)
    x = np.arange(n, dtype=np.float32)
    await q.enqueue((7, x))
    await q.enqueue((-7, -x))
    s = await q.stats()
    assert (s.size, s.enqueued_total, s.spec.class_name) == (2, 2, "PriorityQueue")
    [(p, first)] = await q.peek()
    assert int(p) == -7 and np.array_equal(first, -x)
    prios, vals = await q.dequeue_many(2)
    assert prios.tolist() == [-7, 7] and np.array_equal(vals[1], x)
    prefix = keys.queue_prefix("default", "big")
    assert [k async for k in client.commands.scan_iter(match=prefix + "b:*")] == []


async def test_garbage_member_is_quarantined(client):
    q = prioq(client, shared_name="g")
    await q.enqueue((5, 1))
    items = keys.queue_prefix("default", "g") + "items"
    good = wire.encode([np.int64(0), np.int32(0)])
    await client.commands.zadd(items, {b"short": 0, priority_keys(np.array([1]))[0] + b"xx": 0})
    await client.commands.zadd(items, {priority_keys(np.array([2]))[0] + good[:5]: 0})
    prios, vals = await q.dequeue_many(1)
    assert prios.tolist() == [5] and vals.tolist() == [1]
    assert (await q.stats()).dead_letters == 3


async def _pending_enqueues(q: qps.PriorityQueue, n: int) -> bool:
    return (await q.stats()).pending_enqueues == n


async def _pending_dequeues(q: qps.PriorityQueue, n: int) -> bool:
    return (await q.stats()).pending_dequeues == n
