"""Elements of tens of KB (over ONE_CHUNK_MIN_BYTES, up to a chunk) enqueued on a list
queue are stored out of line in one chunk, written in the enqueue script's round trip,
so that their bytes never pass through Lua; a dequeue of one renames the chunk after
its attempt and reads it in the same round trip. Every path delivers each element
once, intact, and leaves no chunk behind for good."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import WouldBlockError
from qps.queues import large
from tests.conftest import until

N = large.ONE_CHUNK_MIN_BYTES // 4 + 1000  # float32: just over the threshold


def queue(client, capacity=10, name="mid"):
    return qps.FIFOQueue(capacity, np.float32, shapes=[[N]], shared_name=name, client=client)


def element(k: int) -> np.ndarray:
    return (np.arange(N, dtype=np.float32) + k * 1000).astype(np.float32)


async def chunks(client, name="mid") -> dict[bytes, int]:
    """The queue's chunk keys and their TTLs (ms; -1: none)."""
    prefix = keys.queue_prefix("default", name)
    found = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    return {k: await client.commands.pttl(k) for k in found}


async def none_for_good(client, name="mid") -> bool:
    """No chunk left but ones about to expire (a delivered one whose consumer did not
    come back: it expires, CHUNK_TTL_MS)."""
    return all(0 < ttl <= large.CHUNK_TTL_MS for ttl in (await chunks(client, name)).values())


async def test_stored_out_of_line_and_read_with_the_take(client, monkeypatch):
    q = queue(client)
    for k in range(4):
        await q.enqueue(element(k))
    prefix = keys.queue_prefix("default", "mid")
    stored = await client.commands.lrange(prefix + "items", 0, -1)
    assert len(stored) == 4 and all(v.startswith(b"QR|") and b"|1|" in v for v in stored)
    assert sorted((await chunks(client)).values()) == [-1] * 4  # stored: no TTL
    fetched = []
    real = large.fetch_large

    async def counted(*args, **kw):
        fetched.append(1)
        return await real(*args, **kw)

    monkeypatch.setattr("qps.queues.large.fetch_large", counted)
    monkeypatch.setattr("qps.queues.take.fetch_large", counted)
    for k in range(4):
        assert np.array_equal(await q.dequeue(), element(k))
    # the first read its chunk after the take; the others with it
    assert len(fetched) == 1
    with pytest.raises(WouldBlockError):
        await q.dequeue_nowait()  # drops the last delivery's record and chunk
    assert await chunks(client) == {}
    st = await q.stats()
    assert (st.enqueued_total, st.dequeued_total, st.size) == (4, 4, 0)


@pytest.mark.parametrize("acked", [False, True])
async def test_a_waiting_dequeue_gets_it_with_its_chunk(make_client, acked):
    producer, consumer = await make_client(), await make_client()
    qp, qc = queue(producer), queue(consumer)
    await qp.enqueue(element(0))  # the consumer sees one stored out of line first
    first = await (qc.dequeue_acked() if acked else qc.dequeue())
    if acked:
        await qc.ack(first)
    for k in range(1, 4):
        task = asyncio.ensure_future(qc.dequeue_acked() if acked else qc.dequeue())
        await until(lambda: _pending_dequeues(qp, 1))
        await qp.enqueue(element(k))
        got = await asyncio.wait_for(task, 10)
        if acked:
            assert np.array_equal(got.value, element(k))
            left = await chunks(producer)
            assert len(left) == 1 and list(left.values()) == [-1]  # held: kept
            await qc.ack(got)
            assert await chunks(producer) == {}
        else:
            assert np.array_equal(got, element(k))
    st = await qp.stats()
    assert (st.enqueued_total, st.dequeued_total, st.pending_dequeues) == (4, 4, 0)
    if not acked:
        with pytest.raises(WouldBlockError):
            await qc.dequeue_nowait()
    assert await chunks(producer) == {}


async def test_nacked_and_cancelled_deliveries_come_again_intact(make_client):
    producer, consumer = await make_client(), await make_client()
    qp, qc = queue(producer), queue(consumer)
    await qp.enqueue(element(0))
    await qp.enqueue(element(1))
    d = await qc.dequeue_acked()
    await qc.nack(d)  # back to the front, its chunk kept (renamed)
    d = await qc.dequeue_acked()
    assert np.array_equal(d.value, element(0))
    await qc.ack(d)
    assert np.array_equal(await qc.dequeue(), element(1))
    # a waiting dequeue cancelled once the element is handed to it: either it has the
    # element or the element is back in the queue, never both, never neither
    for k in range(2, 6):
        task = asyncio.ensure_future(qc.dequeue())
        await until(lambda: _pending_dequeues(qp, 1))
        await qp.enqueue(element(k))
        task.cancel()
        try:
            got = await task
        except asyncio.CancelledError:
            got = await qc.dequeue(timeout=10)
        assert np.array_equal(got, element(k))
        assert await qc.size() == 0
    with pytest.raises(WouldBlockError):
        await qc.dequeue_nowait()
    assert await none_for_good(producer)


async def test_a_full_queue_and_several_at_once(client):
    q = queue(client, capacity=2)
    await q.enqueue(element(0))
    await q.enqueue(element(1))
    waiting = asyncio.ensure_future(q.enqueue(element(2)))  # full: waits
    await until(lambda: _pending_enqueues(q, 1))
    assert np.array_equal(await q.dequeue_many(2), np.stack([element(0), element(1)]))
    await asyncio.wait_for(waiting, 10)
    assert np.array_equal(await q.dequeue(), element(2))
    with pytest.raises(WouldBlockError):
        await q.dequeue_nowait()
    assert await none_for_good(client)


async def _pending_dequeues(q, n):
    return (await q.stats()).pending_dequeues == n


async def _pending_enqueues(q, n):
    return (await q.stats()).pending_enqueues == n
