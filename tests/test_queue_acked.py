"""Acknowledged (at-least-once) dequeues: dequeue_acked / ack / nack / touch.

Elements stay held for their caller until ack; nack or a lease that runs out (a dead or
stalled caller) puts them back at the front, in order."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import AbortedError, DeadlineExceededError, OutOfRangeError
from tests.conftest import until

I64 = np.int64


def fifo(client, capacity=10, name="acked"):
    return qps.FIFOQueue(capacity, I64, shapes=[[]], shared_name=name, client=client)


async def test_ack_removes_for_good(client):
    q = fifo(client)
    await q.enqueue_many(np.arange(3, dtype=I64))
    d = await q.dequeue_acked()
    assert int(d.value) == 0 and len(d.tokens) == 1
    assert await q.size() == 2
    await q.ack(d)
    assert (await q.dequeue_many(2)).tolist() == [1, 2]
    s = await q.stats()
    assert (s.size, s.dequeued_total, s.pending_dequeues) == (0, 3, 0)
    prefix = keys.queue_prefix("default", "acked")
    assert await client.commands.zcard(prefix + "lease") == 0
    assert int(await client.commands.hget(prefix + "meta", "w")) == 0


async def test_handed_over_and_taken_deliveries_ack_to_nothing(client):
    """A delivery handed to a waiting acknowledged dequeue by an enqueue, and one taken
    from a non-empty queue, are plain: their acks (one call, as a PS shard acks a group)
    leave no record, lease or pending attempt, and the meta's count of leases is 0."""
    q = fifo(client)
    prefix = keys.queue_prefix("default", "acked")
    waiting = asyncio.ensure_future(q.dequeue_acked())
    await until(lambda: _pending_dequeues(q))
    await q.enqueue(I64(7))
    first = await waiting
    await q.enqueue_many(np.arange(2, dtype=I64))
    second = await q.dequeue_acked()
    assert (int(first.value), int(second.value)) == (7, 0)
    assert first.plain and second.plain
    assert await q.held() == 2
    both = qps.queues.base.Delivery(None, first.tokens + second.tokens, True)
    await q.ack(both)
    assert await q.held() == 0
    assert await client.commands.zcard(prefix + "lease") == 0
    assert [k async for k in client.commands.scan_iter(match=prefix + "a:*")] == []
    assert int(await client.commands.hget(prefix + "meta", "w")) == 0
    assert (await q.dequeue()).tolist() == 1  # the rest is untouched


async def _pending_dequeues(q):
    return (await q.stats()).pending_dequeues == 1


async def test_nack_puts_back_at_the_front_in_order(client):
    q = fifo(client)
    await q.enqueue_many(np.arange(5, dtype=I64))
    d1 = await q.dequeue_many_acked(2)
    d2 = await q.dequeue_acked()
    assert d1.value.tolist() == [0, 1] and int(d2.value) == 2
    await q.nack(d2)
    await q.nack(d1)
    assert (await q.dequeue_many(5)).tolist() == [0, 1, 2, 3, 4]
    assert (await q.stats()).dequeued_total == 5


async def test_up_to_on_a_closed_queue(client):
    q = fifo(client)
    await q.enqueue_many(np.arange(2, dtype=I64))
    await q.close()
    d = await q.dequeue_up_to_acked(5)
    assert d.value.tolist() == [0, 1]
    await q.nack(d)
    d = await q.dequeue_up_to_acked(5)
    await q.ack(d)
    with pytest.raises(OutOfRangeError):
        await q.dequeue_acked()


async def test_an_acked_dequeue_of_a_closed_queue_waits_for_held_elements(make_client):
    """Closed and empty, but another consumer holds a delivery: an acknowledged dequeue
    waits for it (it may come back) instead of reporting the end; a plain dequeue reports
    the end at once, as in TF, and so does the holder's own client. A nack hands the
    element over; once nothing is held, the waiting dequeue gets OutOfRange."""
    a, b = fifo(await make_client()), fifo(await make_client())
    await a.enqueue_many(np.arange(2, dtype=I64))
    await a.close()
    d0 = await a.dequeue_acked()
    d1 = await a.dequeue_acked()
    with pytest.raises(OutOfRangeError):
        await a.dequeue_acked()  # its own client's deliveries: it never waits for itself
    with pytest.raises(OutOfRangeError):
        await b.dequeue_up_to(1)  # TF semantics for a plain dequeue
    waiting = asyncio.create_task(b.dequeue_up_to_acked(5))
    await until(lambda: _waits(b))
    await a.nack(d0)  # back to the queue: the waiting dequeue gets it
    got = await waiting
    assert got.value.tolist() == [0]
    waiting = asyncio.create_task(b.dequeue_acked())
    await until(lambda: _waits(b))
    await b.ack(got)
    assert not waiting.done()  # d1 is still held
    await a.ack(d1)  # nothing held any more: the end
    with pytest.raises(OutOfRangeError):
        await waiting
    with pytest.raises(OutOfRangeError):
        await b.dequeue_acked()


async def _waits(q) -> bool:
    return (await q.stats()).pending_dequeues == 1


async def test_a_waiting_acked_dequeue_and_cancellation(client):
    q = fifo(client)
    task = asyncio.create_task(q.dequeue_many_acked(3))
    await q.enqueue_many(np.arange(2, dtype=I64))
    await until(lambda: _held(q, 2))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await q.size() == 2
    task = asyncio.create_task(q.dequeue_many_acked(3))
    await q.enqueue(7)
    d = await asyncio.wait_for(task, 30)
    assert d.value.tolist() == [0, 1, 7]
    await q.ack(d)
    assert await q.size() == 0


async def test_timeout_gives_back(client):
    q = fifo(client)
    await q.enqueue(5)
    with pytest.raises(DeadlineExceededError):
        await q.dequeue_many_acked(2, timeout=0.2)
    assert await q.size() == 1


async def test_fast_paths_beside_held_deliveries_but_not_past_a_lapsed_one(
    make_client, monkeypatch
):
    """An acknowledged delivery held by one consumer does not keep the others off the
    queues' fast paths; one whose lease ran out does: it goes back to the front (the
    full script's reap) before an enqueue hands anything to a waiting consumer."""
    # longer than a wait's 1 s block (waiters renew their own leases once per block)
    monkeypatch.setattr("qps.queues.waiters.LEASE_MS", 2500)
    a, b = await make_client(), await make_client()
    qa, qb = fifo(a), fifo(b)
    prefix = keys.queue_prefix("default", "acked")
    await qa.enqueue_many(np.arange(3, dtype=I64))
    held = await qa.dequeue_acked()  # 0, held by a, never acked
    got = await qb.dequeue_acked()  # beside a's lease
    await qb.enqueue(I64(5))
    assert (int(held.value), int(got.value)) == (0, 1)
    await qb.ack(got)
    assert (await qb.dequeue_many(2)).tolist() == [2, 5]
    waiting = asyncio.ensure_future(qb.dequeue_acked(timeout=30))
    await until(lambda: _pending_dequeues(qb))

    async def lapsed():
        now = await a.commands.time()
        ms = now[0] * 1000 + now[1] // 1000
        return (await a.commands.zscore(prefix + "lease", "r|" + held.tokens[0])) < ms

    await until(lapsed)
    await qa.enqueue(I64(9))  # a lapsed lease: the full script puts 0 back first
    assert int((await waiting).value) == 0
    assert (await qa.dequeue()).tolist() == 9


async def test_expired_lease_redelivers_and_late_ack_fails(make_client, monkeypatch):
    # longer than a wait's 1 s block (waiters renew their own leases once per block)
    monkeypatch.setattr("qps.queues.waiters.LEASE_MS", 2500)
    a, b = await make_client(), await make_client()
    qa, qb = fifo(a), fifo(b)
    await qa.enqueue(10)
    held = await qa.dequeue_acked()  # never acked in time
    assert int(held.value) == 10
    # b waits; its wait renews only its own lease and reaps the stale one
    assert int(await qb.dequeue(timeout=30)) == 10
    with pytest.raises(AbortedError, match="ran out"):
        await qa.ack(held)
    with pytest.raises(AbortedError):
        await qa.touch(held)
    await qa.nack(held)  # already back: not an error
    assert await qa.size() == 0


async def test_large_elements_and_batches_are_released_on_ack_only(client):
    from qps.queues.large import CHUNK_BYTES

    n = CHUNK_BYTES // 4 + 100  # one float32 element just over a chunk
    big = qps.FIFOQueue(4, np.float32, shapes=[[n]], shared_name="big", client=client)
    x = np.arange(n, dtype=np.float32)
    await big.enqueue(x)
    d = await big.dequeue_acked()
    assert np.array_equal(d.value, x)
    await big.nack(d)  # the chunks are still there
    d = await big.dequeue_acked()
    assert np.array_equal(d.value, x)
    await big.ack(d)
    rows = qps.FIFOQueue(256, np.float32, shapes=[[784]], shared_name="rows", client=client)
    xs = np.random.default_rng(1).standard_normal((128, 784), dtype=np.float32)
    await rows.enqueue_many(xs)
    d = await rows.dequeue_many_acked(100)
    assert np.array_equal(d.value, xs[:100])
    await rows.nack(d)
    d = await rows.dequeue_many_acked(128)
    assert np.array_equal(d.value, xs)
    await rows.ack(d)
    for name in ("big", "rows"):
        prefix = keys.queue_prefix("default", name)
        assert [k async for k in client.commands.scan_iter(match=prefix + "b:*")] == []


async def test_touch_keeps_the_lease(make_client, monkeypatch):
    monkeypatch.setattr("qps.queues.waiters.LEASE_MS", 2000)
    a, b = await make_client(), await make_client()
    qa, qb = fifo(a), fifo(b)
    await qa.enqueue(1)
    d = await qa.dequeue_acked()
    waiter = asyncio.create_task(qb.dequeue(timeout=3))
    while not waiter.done():  # keep renewing while b waits (and reaps) past the lease
        await qa.touch(d)
        await asyncio.sleep(0.2)  # paces the renewals: a stall of up to 1.8 s is absorbed
    with pytest.raises(DeadlineExceededError):
        await waiter
    await qa.ack(d)
    assert await qa.size() == 0


CHILD = """
import asyncio, sys, numpy as np, qps
async def main(url):
    async with await qps.connect(url) as c:
        q = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="acked-crash", client=c)
        d = await q.dequeue_many_acked(2)
        print("HELD", flush=True)
        await asyncio.sleep(60)
asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.slow
async def test_killed_consumer_elements_are_redelivered(redis_url):
    async with await qps.connect(redis_url) as client:
        await qps.queues.delete_queue(client, "acked-crash")
        q = fifo(client, name="acked-crash")
        await q.enqueue_many(np.array([1, 2, 3], I64))
        env = {**os.environ, "QPS_LEASE_MS": "2000", "PYTHONPATH": str(Path(__file__).parents[1])}
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, redis_url, env=env, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert child.stdout is not None
            assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"HELD"
            assert await q.size() == 1
            os.kill(child.pid, signal.SIGKILL)
            await child.wait()
            # the dead consumer's elements go back to the front of the queue; this
            # dequeue already held 3 when they came back
            assert (await q.dequeue_many(3, timeout=30)).tolist() == [3, 1, 2]
        finally:
            if child.returncode is None:
                child.kill()
        await qps.queues.delete_queue(client, "acked-crash")


async def _held(q, n):
    s = await q.stats()
    return s.pending_dequeues == 1 and s.held == n


async def test_reclaim_puts_back_what_consumers_hold_in_order(make_client):
    """reclaim(): the deliveries a (dead) consumer holds go back to the front, the
    oldest first, and a waiting dequeue is cancelled; enqueues waiting on a full queue
    are left alone. A later ack of a reclaimed delivery is refused, as after its lease."""
    dead, me = await make_client(), await make_client()
    q_dead, q = fifo(dead, capacity=6), fifo(me, capacity=6)
    await q.enqueue_many(np.arange(6, dtype=I64))
    d1 = await q_dead.dequeue_many_acked(2)
    d2 = await q_dead.dequeue_acked()
    assert await q.held() == 2 and await q.size() == 3
    await q.enqueue_many(np.arange(6, 9, dtype=I64))  # fills the queue: 3 wait

    blocked = asyncio.ensure_future(q.enqueue(np.int64(100)))

    async def waiting() -> bool:
        return (await q.stats()).pending_enqueues == 1

    await until(waiting)
    assert await q.reclaim() == 2
    assert await q.held() == 0
    assert blocked.done() is False  # still waiting: the queue is full again
    got = await q.dequeue_many(6)
    assert got.tolist() == [0, 1, 2, 3, 4, 5]
    await asyncio.wait_for(blocked, 10)  # the dequeue made room for it
    assert (await q.dequeue_many(4)).tolist() == [6, 7, 8, 100]
    with pytest.raises(AbortedError):
        await q_dead.ack(d1)
    with pytest.raises(AbortedError):
        await q_dead.ack(d2)
    assert await q.reclaim() == 0 and await q.size() == 0


async def _pending_enqueues(q, n=1):
    return (await q.stats()).pending_enqueues == n


@pytest.mark.parametrize("acked", [False, True])
async def test_a_dequeue_admits_the_enqueue_waiting_for_room(client, acked):
    """A full queue with one enqueue waiting (a PS shard's gradient queue whose workers
    are ahead): a dequeue takes the head and admits the waiting element; the enqueue
    completes and nothing is left of its attempt (its lease, its pending list)."""
    q = fifo(client, capacity=2, name=f"admit{int(acked)}")
    prefix = keys.queue_prefix("default", f"admit{int(acked)}")
    await q.enqueue_many(np.arange(2, dtype=I64))
    for k in range(3):  # three rounds: each dequeue admits the waiting enqueue
        blocked = asyncio.ensure_future(q.enqueue(I64(10 + k)))
        await until(lambda: _pending_enqueues(q))
        waiting = (await client.commands.lindex(prefix + "ew", 0)).decode()[2:]
        if acked:
            d = await q.dequeue_acked()
            got = int(d.value)
            await q.ack(d)
        else:
            got = int(await q.dequeue())
        await blocked
        assert got == [0, 1, 10][k]
        s = await q.stats()
        assert (s.size, s.pending_enqueues, s.enqueued_total) == (2, 0, 3 + k)
        assert await client.commands.zcard(prefix + "lease") == int(
            await client.commands.hget(prefix + "meta", "w")
        )
        assert not await client.commands.exists(f"{prefix}a:{waiting}:p")
    assert (await q.dequeue_many(2)).tolist() == [11, 12]
    assert await client.commands.zcard(prefix + "lease") == 0


@pytest.mark.parametrize("waiting", [3, 5])
async def test_waiting_rows_are_admitted_as_room_is_made(client, waiting):
    """A waiting enqueue_many with several elements left, as plain entries (3 rows of
    16 KiB) or as one 'QB|' batch entry standing for several (5 rows, one buffer): each
    dequeue admits what fits (splitting the entry), in order, never past the capacity."""
    name = f"admitrows{waiting}"
    q = qps.FIFOQueue(3, np.float32, shapes=[[64, 64]], shared_name=name, client=client)
    rows = np.arange((2 + waiting) * 64 * 64, dtype=np.float32).reshape(-1, 64, 64)
    await q.enqueue(rows[0])
    await q.enqueue(rows[1])
    blocked = asyncio.ensure_future(q.enqueue_many(rows[2:]))  # one fits, the rest waits
    await until(lambda: _pending_enqueues(q))
    prefix = keys.queue_prefix("default", name)
    waiter = (await client.commands.lindex(prefix + "ew", 0)).decode()[2:]
    entries = await client.commands.lrange(f"{prefix}a:{waiter}:p", 0, -1)
    assert len(entries) == (1 if waiting == 5 else 2)  # the 5 rows are one batch entry
    for k in range(waiting - 1):
        assert (await q.stats()).size == 3
        assert float((await q.dequeue())[0, 0]) == rows[k, 0, 0]
    await blocked
    s = await q.stats()
    assert (s.size, s.pending_enqueues, s.enqueued_total) == (3, 0, 2 + waiting)
    assert (await q.dequeue_many(3)).tolist() == rows[-3:].tolist()


async def test_waiting_enqueues_are_admitted_one_per_dequeue_in_order(client):
    q = fifo(client, capacity=2, name="admit2")
    prefix = keys.queue_prefix("default", "admit2")
    await q.enqueue_many(np.arange(2, dtype=I64))
    first = asyncio.ensure_future(q.enqueue(I64(10)))
    await until(lambda: _pending_enqueues(q))
    second = asyncio.ensure_future(q.enqueue(I64(11)))
    await until(lambda: _pending_enqueues(q, 2))
    assert int(await q.dequeue()) == 0
    await first
    s = await q.stats()
    assert (s.size, s.pending_enqueues) == (2, 1)  # the room went to the first waiter
    assert int(await q.dequeue()) == 1
    await second
    assert (await q.dequeue_many(2)).tolist() == [10, 11]
    assert await client.commands.zcard(prefix + "lease") == 0
    assert int(await client.commands.hget(prefix + "meta", "w")) == 0
