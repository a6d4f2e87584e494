"""Large enqueue_many batches travel as one buffer per batch (qps/queues/large.py):
the queue holds one small reference per row, consumers read their rows with GETRANGE,
and the buffer is deleted with its last row, whatever path the rows take."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import CancelledError, DeadlineExceededError, WouldBlockError
from qps.queues.large import BATCH_ENTRY, BATCH_MIN_BYTES, BATCH_REF
from tests.conftest import until

WIDTH = 784  # one row: float32[784] + int64, about 3.2 KB: 128 rows are one buffer


def batch(k: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(start, start + k, dtype=np.int64)
    x = (ids[:, None] + np.arange(WIDTH, dtype=np.float32)[None, :] / 1000).astype(np.float32)
    return x, ids


def queue(client, capacity=1024, name="b", cls=qps.FIFOQueue, **kw):
    return cls(capacity, [np.float32, np.int64], shapes=[[WIDTH], []], shared_name=name,
               client=client, **kw)  # fmt: skip


async def buffer_keys(client, name="b") -> list[bytes]:
    prefix = keys.queue_prefix("default", name)
    return sorted([k async for k in client.commands.scan_iter(match=prefix + "b:*")])


async def no_buffers(client, name="b") -> bool:
    """Whether no batch buffer (or unread count) is left for good: a delivery of a
    buffer's last rows takes the buffer along (read in the same round trip), and the
    consumer's next dequeue drops it, else it expires with the delivery record (60 s).
    So every key left must be about to expire."""
    for key in await buffer_keys(client, name):
        if not 0 < await client.commands.pttl(key) <= 60_000:
            return False
    return True


async def stored(client, name="b") -> list[bytes]:
    prefix = keys.queue_prefix("default", name)
    return await client.commands.lrange(prefix + "items", 0, -1)


def check(out: tuple[np.ndarray, np.ndarray], ids: list[int]) -> None:
    x, y = out
    assert y.tolist() == ids
    assert np.array_equal(x, np.stack([batch(1, i)[0][0] for i in ids]))


def test_threshold_is_what_w2_needs():
    x, y = batch(128)
    assert x.nbytes + y.nbytes > BATCH_MIN_BYTES


async def test_rows_are_references_and_the_buffer_goes_with_the_last_row(client):
    q = queue(client)
    await q.enqueue_many(batch(128))
    items = await stored(client)
    assert len(items) == 1 and items[0].startswith(BATCH_ENTRY)  # one entry, 128 rows
    assert (await q.size(), (await q.stats()).size) == (128, 128)
    assert len(await buffer_keys(client)) == 2  # the buffer and its unread count
    check(await q.dequeue_many(50), list(range(50)))
    assert await stored(client) == [items[0].replace(b"|0|128|", b"|50|78|")]  # split
    assert len(await buffer_keys(client)) == 2  # 78 rows unread
    [(x0, y0)] = await q.peek()  # peek reads a row without consuming it
    assert int(y0) == 50 and np.array_equal(x0, batch(1, 50)[0][0])
    check(await q.dequeue_many(78), list(range(50, 128)))
    assert await no_buffers(client)  # taken along by the last delivery, with a TTL
    with pytest.raises(WouldBlockError):
        await q.dequeue_nowait()  # the next call drops it
    assert await buffer_keys(client) == []
    s = await q.stats()
    assert (s.size, s.enqueued_total, s.dequeued_total) == (0, 128, 128)


async def test_single_dequeues_and_several_batches(client):
    q = queue(client)
    await q.enqueue_many(batch(64, 0))
    await q.enqueue_many(batch(64, 64))
    got = [int((await q.dequeue())[1]) for _ in range(10)]
    check(await q.dequeue_many(118), list(range(10, 128)))
    assert got == list(range(10)) and await no_buffers(client)


async def test_two_consumers_share_a_buffer(make_client):
    a, b = await make_client(), await make_client()
    qa, qb = queue(a), queue(b)
    await qa.enqueue_many(batch(128))
    _x1, y1 = await qb.dequeue_many(64)
    _x2, y2 = await qa.dequeue_many(64)
    assert sorted(y1.tolist() + y2.tolist()) == list(range(128))
    assert await no_buffers(a)


async def test_closed_and_nowait_refusals_leave_no_buffer(client):
    q = queue(client, capacity=100)
    with pytest.raises(WouldBlockError):
        await q.enqueue_many_nowait(batch(128))
    assert await no_buffers(client) and await q.size() == 0
    await q.close()
    with pytest.raises(CancelledError):
        await q.enqueue_many(batch(128))
    assert await no_buffers(client)


async def test_timed_out_enqueue_keeps_its_prefix_and_releases_the_rest(client):
    q = queue(client, capacity=100)
    with pytest.raises(DeadlineExceededError):
        await q.enqueue_many(batch(128), timeout=0.2)
    assert await q.size() == 100
    prefix = keys.queue_prefix("default", "b")
    [bid] = {i.split(b"|")[1] for i in await stored(client)}
    assert int(await client.commands.get(prefix.encode() + b"b:" + bid + b":u")) == 100
    check(await q.dequeue_many(100), list(range(100)))
    assert await no_buffers(client)


async def test_enqueue_many_larger_than_capacity_with_a_consumer(client):
    q = queue(client, capacity=50)
    producer = asyncio.create_task(q.enqueue_many(batch(128)))
    got: list[int] = []
    while len(got) < 128:
        got += (await q.dequeue_many(16))[1].tolist()
    await producer
    assert got == list(range(128)) and await no_buffers(client)


async def test_missing_buffer_rows_are_dead_letters(client):
    q = queue(client)
    await q.enqueue_many(batch(128))
    prefix = keys.queue_prefix("default", "b")
    [entry] = await stored(client)
    bid, row = entry.split(b"|")[1], int(entry.split(b"|")[4])
    await client.commands.delete(prefix.encode() + b"b:" + bid)
    await q.enqueue_many(batch(1, 500))  # a good element behind the damaged batch
    _x, y = await q.dequeue_many(1)
    assert y.tolist() == [500]
    s = await q.stats()
    # the row taken and the rest of the entry are set aside at once: two records, in one
    # dequeue (not a round of the loop per row of a batch that is gone)
    assert s.dead_letters == 2 and s.size == 0
    records = [msgpack.unpackb(r) for r in await client.commands.lrange(prefix + "dlq", 0, -1)]
    assert [r["data"] for r in records] == [
        b"QB|%s|0|1|%d" % (bid, row),
        b"QB|%s|1|127|%d" % (bid, row),
    ]
    assert await no_buffers(client)


def _shuffle(client):
    return qps.RandomShuffleQueue(1024, 0, [np.float32, np.int64], shapes=[[WIDTH], []],
                                  seed=3, shared_name="b", client=client)  # fmt: skip


@pytest.mark.parametrize("kind", [queue, _shuffle], ids=["fifo", "shuffle"])
async def test_failed_read_gives_rows_back_in_order(client, monkeypatch, kind):
    q = kind(client)
    await q.enqueue_many(batch(128))
    real = type(client).run_commands_then_script
    calls = 0

    async def flaky(self, commands, name, *args, **kw):
        nonlocal calls
        if name == "release":
            calls += 1
            if calls == 1:  # before anything is sent: the rows are still in place
                raise qps.errors.UnavailableError("injected")
        return await real(self, commands, name, *args, **kw)

    monkeypatch.setattr(type(client), "run_commands_then_script", flaky)
    with pytest.raises(qps.errors.UnavailableError):
        await q.dequeue_many(10)
    assert await q.size() == 128
    _, ids = await q.dequeue_many(128)
    want = list(range(128))
    assert (ids.tolist() if kind is queue else sorted(ids.tolist())) == want
    assert await no_buffers(client)


async def test_cancelled_waiting_dequeue_many_gives_rows_back(client):
    q = queue(client)
    await q.enqueue_many(batch(64))
    task = asyncio.create_task(q.dequeue_many(100))
    await until(lambda: _held(q, 64))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await q.size() == 64
    check(await q.dequeue_many(64), list(range(64)))
    assert await no_buffers(client)


async def test_shuffle_and_priority_queues(client):
    s = qps.RandomShuffleQueue(1024, 0, [np.float32, np.int64], shapes=[[WIDTH], []],
                               seed=3, shared_name="s", client=client)  # fmt: skip
    await s.enqueue_many(batch(128))
    _, ids = await s.dequeue_many(128)
    assert sorted(ids.tolist()) == list(range(128)) and ids.tolist() != list(range(128))
    assert await no_buffers(client, "s")
    p = qps.PriorityQueue(1024, [np.float32], [[WIDTH]], shared_name="p", client=client)
    x, ids = batch(128)
    await p.enqueue_many((-ids, x))
    prios, xs = await p.dequeue_many(128)
    assert prios.tolist() == list(range(-127, 1)) and np.array_equal(xs, x[::-1])
    assert await no_buffers(client, "p")


async def test_small_batches_stay_inline(client):
    q = qps.FIFOQueue(1000, np.float32, shapes=[[4]], shared_name="small", client=client)
    await q.enqueue_many(np.zeros((100, 4), np.float32))
    assert not any(i.startswith(BATCH_REF) for i in await stored(client, "small"))


async def _held(q, n):
    return (await q.stats()).held == n


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_batches_and_takes_keep_order_and_count(make_client, seed):
    """A batch entry stands for many rows: the scripts split it when an enqueue only
    partly fits and when a dequeue takes part of it. One producer of random large
    batches and two consumers of random sizes: every row arrives once, each consumer
    sees rows in order, the size (rows, not entries) never exceeds the capacity, and no
    buffer is left."""
    import random

    rng = random.Random(seed)
    cap = 200
    producer_client, c1, c2, watcher = [await make_client() for _ in range(4)]
    sizes = [rng.randint(21, 160) for _ in range(14)]
    total = sum(sizes)
    qp = queue(producer_client, capacity=cap, name="r")
    seen: list[int] = []

    async def produce() -> None:
        start = 0
        for k in sizes:
            await qp.enqueue_many(batch(k, start))
            start += k
        await qp.close()

    async def consume(client, out: list[int]) -> None:
        q = queue(client, capacity=cap, name="r")
        r = random.Random(seed * 10 + len(out))
        while True:
            op = r.choice(["one", "many", "upto"])
            n = r.randint(1, 90)
            try:
                if op == "one":
                    out.append(int((await q.dequeue())[1]))
                elif op == "many":
                    out.extend((await q.dequeue_many(n))[1].tolist())
                else:
                    out.extend((await q.dequeue_up_to(n))[1].tolist())
            except qps.errors.OutOfRangeError:
                if op == "many":
                    continue  # a closed queue may still hold fewer than n
                return

    async def watch() -> None:
        q = queue(watcher, capacity=cap, name="r")
        while not await q.is_closed() or await q.size() > 0:
            size = await q.size()
            seen.append(size)
            assert 0 <= size <= cap
            await asyncio.sleep(0.005)

    a: list[int] = []
    b: list[int] = []
    w = asyncio.create_task(watch())
    await asyncio.gather(produce(), consume(c1, a), consume(c2, b))
    await w
    assert sorted(a + b) == list(range(total))
    assert a == sorted(a) and b == sorted(b)
    assert await no_buffers(watcher, "r")
    s = await queue(watcher, capacity=cap, name="r").stats()
    assert (s.size, s.enqueued_total, s.dequeued_total) == (0, total, total)
    assert seen  # the watcher looked at least once


async def test_cancelled_consumer_of_a_handed_over_buffer_loses_nothing(make_client):
    """The delivery of a buffer's last rows renames the buffer after the consumer's
    attempt. Cancelling that consumer at any point either leaves it with the rows or
    puts them back (the buffer persisted under its new name): never both, never none."""
    producer, consumer = await make_client(), await make_client()
    qp, qc = queue(producer), queue(consumer)
    for start in range(0, 640, 128):
        task = asyncio.create_task(qc.dequeue_many(128))
        await until(lambda: _pending_dequeues(qp, 1))
        await qp.enqueue_many(batch(128, start))
        task.cancel()
        try:
            got = (await task)[1].tolist()
        except asyncio.CancelledError:
            got = []
        if got:
            assert got == list(range(start, start + 128))
            assert await qc.size() == 0
        else:
            assert (await qc.dequeue_many(128))[1].tolist() == list(range(start, start + 128))
    assert await no_buffers(producer)


async def _pending_dequeues(q, n):
    return (await q.stats()).pending_dequeues == n


async def test_a_buffer_read_that_failed_with_the_reply_is_read_anew(client, monkeypatch):
    """A delivery of a whole buffer reads it in the reply's round trip; when that read
    comes back as an error (in its place, not raised), the rows are read anew."""
    from qps import transport
    from qps.errors import InternalError

    q = queue(client)
    await q.enqueue_many(batch(128))
    real = transport.Client.run_script_then_commands

    async def broken(self, name, keys, args, after, **kw):
        reply, replies = await real(self, name, keys, args, after, **kw)
        return reply, [InternalError("lost (test)") for _ in replies]

    monkeypatch.setattr(transport.Client, "run_script_then_commands", broken)
    check(await q.dequeue_many(128), list(range(128)))
    monkeypatch.undo()
    assert await q.size() == 0
    with pytest.raises(WouldBlockError):
        await q.dequeue_nowait()  # drops the record
    assert await no_buffers(client)


@pytest.mark.parametrize(
    "take, rows, acked",
    [
        ("many", 128, False),  # exactly the batch's rows: handed over, buffer and all
        ("upto", 128, False),
        ("many", 64, False),  # fewer rows than the batch: the rest stays stored
        ("many", 128, True),  # an acknowledged dequeue reads its rows by reference
    ],
)
async def test_a_batch_for_a_waiting_dequeue(make_client, take, rows, acked):
    """A batch enqueued while a dequeue waits on the empty queue goes to it (in one
    script when the dequeue asks for exactly the batch's rows and is not acknowledged,
    the buffer renamed after its attempt): the rows arrive once, in order, the totals
    count them, nothing is left pending, and the buffer goes once they are read."""
    producer, consumer = await make_client(), await make_client()
    qp, qc = queue(producer), queue(consumer)
    if acked:
        call = qc.dequeue_many_acked(rows)
    else:
        call = qc.dequeue_many(rows) if take == "many" else qc.dequeue_up_to(rows)
    task = asyncio.ensure_future(call)
    await until(lambda: _pending_dequeues(qp, 1))
    await qp.enqueue_many(batch(128))
    got = await asyncio.wait_for(task, 10)
    if acked:
        check(got.value, list(range(rows)))
        await qc.ack(got)
    else:
        check(got, list(range(rows)))
    st = await qp.stats()
    assert (st.enqueued_total, st.dequeued_total) == (128, rows)
    assert (st.size, st.pending_enqueues, st.pending_dequeues, st.held) == (128 - rows, 0, 0, 0)
    if rows < 128:
        check(await qc.dequeue_many(128 - rows), list(range(rows, 128)))
    with pytest.raises(WouldBlockError):
        await qc.dequeue_nowait()  # drops the last delivery's record
    assert await buffer_keys(producer) == []
