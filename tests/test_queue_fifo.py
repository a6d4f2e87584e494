"""FIFOQueue against the conformance cases of docs/queues.md, "Conformance with
TensorFlow 1.x" (numbers in names)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qps
import qps.keys
from qps.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    OutOfRangeError,
    WouldBlockError,
)
from tests.conftest import until, within

# every wait for a pending call to end is bounded: a defect fails in seconds, naming
# what did not happen, instead of hanging until the test's timeout
BOUND = 20

I32 = np.int32


def fifo(client, capacity=10, dtypes=I32, shapes=(), **kw):
    return qps.FIFOQueue(
        capacity, dtypes, shapes=list(shapes) if shapes is not None else None, client=client, **kw
    )


async def stats(q):
    return await q.stats()


async def test_01_full_queue_blocks_and_timeout_inserts_nothing(client):
    q = fifo(client, 2)
    await q.enqueue(1)
    await q.enqueue(2)
    with pytest.raises(DeadlineExceededError):
        await q.enqueue(3, timeout=0.2)
    assert await q.size() == 2
    assert [int(await q.dequeue()) for _ in range(2)] == [1, 2]
    assert await q.size() == 0
    s = await stats(q)
    assert s.pending_enqueues == 0 and s.enqueued_total == 2


async def test_02_dequeue_order_then_blocks(client):
    q = fifo(client, 2)
    await q.enqueue_many(np.array([1, 2], I32))
    assert int(await q.dequeue()) == 1
    assert int(await q.dequeue()) == 2
    with pytest.raises(DeadlineExceededError):
        await q.dequeue(timeout=0.2)
    assert (await stats(q)).pending_dequeues == 0


async def test_03_unbounded_capacity(client):
    q = fifo(client, -1)
    await q.enqueue_many(np.arange(100_000, dtype=I32))
    assert await q.size() == 100_000
    assert q.capacity == -1
    out = await q.dequeue_many(100_000)
    assert np.array_equal(out, np.arange(100_000, dtype=I32))


async def test_04_capacity_zero_blocks_every_enqueue(client):
    q = fifo(client, 0)
    with pytest.raises(DeadlineExceededError):
        await q.enqueue(1, timeout=0.2)
    assert await q.size() == 0


async def test_05_enqueue_many_prefix_stays_after_cancel(client):
    q = fifo(client, 2)
    task = asyncio.create_task(q.enqueue_many(np.array([7, 8, 9], I32)))
    await until(lambda: _pending_enq(q, 1))
    assert await q.size() == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task, BOUND, "a cancelled enqueue_many ends")
    assert await q.size() == 2
    assert (await stats(q)).pending_enqueues == 0
    assert list(await q.dequeue_many(2)) == [7, 8]
    with pytest.raises(DeadlineExceededError):
        await q.dequeue(timeout=0.2)  # 9 was never inserted


async def test_05b_enqueue_many_timeout_keeps_prefix(client):
    q = fifo(client, 2)
    with pytest.raises(DeadlineExceededError):
        await q.enqueue_many(np.array([7, 8, 9], I32), timeout=0.2)
    assert list(await q.dequeue_many(2)) == [7, 8]
    assert await q.size() == 0


async def test_06_enqueue_many_larger_than_capacity_with_consumer(client):
    q = fifo(client, 3)
    producer = asyncio.create_task(q.enqueue_many(np.arange(1, 6, dtype=I32)))
    got = [int(await q.dequeue(timeout=10)) for _ in range(5)]
    await within(producer, BOUND, "enqueue_many of 5 into capacity 3 ends as they are consumed")
    assert got == [1, 2, 3, 4, 5]


async def test_07_dequeue_many_larger_than_capacity(client):
    q = fifo(client, 2)
    consumer = asyncio.create_task(q.dequeue_many(5, timeout=10))
    await q.enqueue_many(np.arange(1, 6, dtype=I32), timeout=10)
    assert list(await within(consumer, BOUND, "dequeue_many(5) returns once 5 were enqueued")) == [
        1,
        2,
        3,
        4,
        5,
    ]


async def test_08_dequeue_many_zero(client):
    q = fifo(client, 2, np.float32, shapes=[[3]])
    out = await q.dequeue_many(0)
    assert out.shape == (0, 3) and out.dtype == np.float32
    await q.close()
    assert (await q.dequeue_many(0)).shape == (0, 3)
    assert (await q.dequeue_up_to(0)).shape == (0, 3)


async def test_09_negative_count(client):
    q = fifo(client)
    with pytest.raises(InvalidArgumentError, match="requested -1 < 0"):
        await q.dequeue_many(-1)
    with pytest.raises(InvalidArgumentError):
        await q.dequeue_up_to(-1)


async def test_10_empty_enqueue_many_on_closed_queue(client):
    q = fifo(client)
    await q.close()
    await q.enqueue_many(np.array([], I32))
    assert await q.size() == 0


async def test_11_dequeue_many_needs_shapes(client):
    q = qps.FIFOQueue(5, I32, client=client)
    await q.enqueue(1)
    with pytest.raises(
        InvalidArgumentError, match="require the components to have specified shapes"
    ):
        await q.dequeue_many(1)
    with pytest.raises(InvalidArgumentError, match="specified shapes"):
        await q.dequeue_up_to(1)
    assert int(await q.dequeue()) == 1  # a single dequeue works without shapes


async def test_12_closed_dequeue_many_insufficient(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    await q.close()
    with pytest.raises(OutOfRangeError, match=r"requested 3, current size 2"):
        await q.dequeue_many(3)
    assert await q.size() == 2


async def test_13_closed_dequeue_up_to(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    await q.close()
    assert list(await q.dequeue_up_to(3)) == [1, 2]
    with pytest.raises(OutOfRangeError):
        await q.dequeue_up_to(3)


async def test_14_closed_empty_dequeue(client):
    q = fifo(client)
    await q.close()
    with pytest.raises(
        OutOfRangeError,
        match=r"is closed and has insufficient elements \(requested 1, current size 0\)",
    ):
        await q.dequeue()


async def test_15_pending_up_to_returns_partial_on_close(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    task = asyncio.create_task(q.dequeue_up_to(3))
    await until(lambda: _held(q, 2))
    assert await q.size() == 0
    await q.close()
    assert list(await within(task, BOUND, "a pending dequeue_up_to returns its 2 on close")) == [
        1,
        2,
    ]


async def test_16_pending_dequeue_many_restores_on_close(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    task = asyncio.create_task(q.dequeue_many(3))
    await until(lambda: _held(q, 2))
    assert await q.size() == 0  # held elements do not count
    await q.close()
    with pytest.raises(OutOfRangeError):
        await within(task, BOUND, "a pending dequeue_many ends on close")
    assert await q.size() == 2
    assert list(await q.dequeue_up_to(3)) == [1, 2]


async def test_17_head_of_line_blocking(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    many = asyncio.create_task(q.dequeue_many(3))
    await until(lambda: _held(q, 2))
    one = asyncio.create_task(q.dequeue())
    await until(lambda: _pending_deq(q, 2))
    await q.enqueue(3)
    assert list(await within(many, BOUND, "dequeue_many(3) returns once the third arrives")) == [
        1,
        2,
        3,
    ]
    assert not one.done() or int(one.result()) == 4
    await q.enqueue(4)
    assert int(await within(one, BOUND, "the dequeue behind it gets the fourth element")) == 4
    await _lease_count_consistent(q)


async def test_18_enqueue_after_close(client):
    q = fifo(client)
    await q.close()
    with pytest.raises(CancelledError, match="is closed"):
        await q.enqueue(1)
    with pytest.raises(CancelledError, match="is closed"):
        await q.enqueue_many(np.array([1], I32))


async def test_19_second_close(client):
    q = fifo(client)
    await q.close()
    with pytest.raises(CancelledError, match="already closed"):
        await q.close()
    await q.close(cancel_pending_enqueues=True)  # no error
    assert await q.is_closed()


async def test_20_close_waits_behind_pending_enqueue(client):
    q = fifo(client, 1)
    await q.enqueue(1)
    enq = asyncio.create_task(q.enqueue(2))
    await until(lambda: _pending_enq(q, 1))
    closer = asyncio.create_task(q.close())
    await until(lambda: _pending_close(q))
    assert not await q.is_closed()
    late = asyncio.create_task(q.enqueue(3))  # queued behind the pending close
    await until(lambda: _pending_enq(q, 2))
    assert int(await q.dequeue()) == 1
    await within(enq, BOUND, "the pending enqueue goes in once there is room")
    await within(closer, BOUND, "the close takes effect after the enqueue before it")
    assert await q.is_closed()
    with pytest.raises(CancelledError, match="is closed"):
        await within(late, BOUND, "an enqueue queued behind the close fails")
    assert int(await q.dequeue()) == 2
    with pytest.raises(OutOfRangeError):
        await q.dequeue()
    await _lease_count_consistent(q)


async def test_21_close_with_cancel(client):
    q = fifo(client, 1)
    await q.enqueue(1)
    enq = asyncio.create_task(q.enqueue(2))
    await until(lambda: _pending_enq(q, 1))
    closing = q.close(cancel_pending_enqueues=True)
    await within(closing, BOUND, "a cancelling close takes effect behind a pending enqueue")
    with pytest.raises(CancelledError, match="Enqueue operation was cancelled"):
        await within(enq, BOUND, "close(cancel_pending_enqueues=True) cancels the pending enqueue")
    assert int(await q.dequeue()) == 1
    with pytest.raises(OutOfRangeError):
        await q.dequeue()


async def test_22_close_cancel_keeps_enqueue_many_prefix(client):
    q = fifo(client, 2)
    enq = asyncio.create_task(q.enqueue_many(np.arange(4, dtype=I32)))
    await until(lambda: _pending_enq(q, 1))
    closing = q.close(cancel_pending_enqueues=True)
    await within(closing, BOUND, "a cancelling close takes effect behind a pending enqueue")
    with pytest.raises(CancelledError):
        await within(
            enq, BOUND, "close(cancel_pending_enqueues=True) cancels the pending enqueue_many"
        )
    assert await q.size() == 2


async def test_23_pending_dequeue_gets_out_of_range_on_close(client):
    q = fifo(client)
    task = asyncio.create_task(q.dequeue())
    await until(lambda: _pending_deq(q, 1))
    await q.close()
    with pytest.raises(OutOfRangeError):
        await within(task, BOUND, "a pending dequeue fails when the queue closes")


async def test_24_client_close_cancels_pending_dequeue(make_client):
    a = await make_client()
    b = await make_client()
    qa = qps.FIFOQueue(5, I32, shapes=[[]], shared_name="q24", client=a)
    qb = qps.FIFOQueue(5, I32, shapes=[[]], shared_name="q24", client=b)
    await qb.enqueue(5)
    await qb.dequeue()
    task = asyncio.create_task(qa.dequeue())
    await until(lambda: _pending_deq(qb, 1))
    await a.close()
    with pytest.raises(CancelledError, match="Dequeue operation was cancelled"):
        await within(task, BOUND, "closing its client cancels a pending dequeue")
    s = await qb.stats()
    assert s.pending_dequeues == 0
    await qb.enqueue(6)
    assert int(await qb.dequeue()) == 6


async def test_25_is_closed_and_size(client):
    q = fifo(client)
    assert await q.is_closed() is False
    await q.enqueue(1)
    size = await q.size()
    assert size == 1 and isinstance(size, int)
    await q.close()
    assert await q.is_closed() is True


# -- validation ---------------------------------------------------------------------------


async def test_26_shape_mismatch(client):
    q = qps.FIFOQueue(5, [I32, np.float32], shapes=[[], [2]], client=client)
    with pytest.raises(
        InvalidArgumentError,
        match=r"Shape mismatch in tuple component 1. Expected \[2\], got \[3\]",
    ):
        await q.enqueue([1, np.zeros(3, np.float32)])
    assert await q.size() == 0


async def test_27_enqueue_many_shape_mismatch(client):
    q = qps.FIFOQueue(5, [I32, np.float32], shapes=[[], [2]], client=client)
    with pytest.raises(
        InvalidArgumentError, match=r"Expected \[2,2\], got \[1,2\]|same size in the 0th"
    ):
        await q.enqueue_many([np.array([1, 2], I32), np.zeros((1, 2), np.float32)])
    with pytest.raises(InvalidArgumentError, match=r"Expected \[2,2\], got \[2,3\]"):
        await q.enqueue_many([np.array([1, 2], I32), np.zeros((2, 3), np.float32)])
    assert await q.size() == 0


async def test_28_batch_dim_mismatch_without_shapes(client):
    q = qps.FIFOQueue(5, [I32, I32], client=client)
    with pytest.raises(
        InvalidArgumentError,
        match=r"All input tensors must have the same size in the 0th dimension\. Component 1 has 3, and should have 2",
    ):
        await q.enqueue_many([np.zeros(2, I32), np.zeros(3, I32)])


def test_29_shapes_must_be_fully_defined():
    with pytest.raises(InvalidArgumentError, match="All shapes must be fully defined"):
        qps.FIFOQueue(5, I32, shapes=[[None]])


async def test_30_named_queue(client):
    q = qps.FIFOQueue(5, [I32, np.float32], shapes=[[], []], names=["a", "b"], client=client)
    with pytest.raises(
        InvalidArgumentError, match="Keys in dictionary to enqueue do not match names"
    ):
        await q.enqueue({"a": 1})
    with pytest.raises(InvalidArgumentError, match="must enqueue a dictionary"):
        await q.enqueue([1, 2.0])
    await q.enqueue({"a": 1, "b": 2.5})
    out = await q.dequeue()
    assert set(out) == {"a", "b"} and int(out["a"]) == 1 and float(out["b"]) == 2.5
    unnamed = fifo(client)
    with pytest.raises(InvalidArgumentError, match="must have names"):
        await unnamed.enqueue({"a": 1})


async def test_31_arity_mismatch_rejected_both_ways(client):
    q = qps.FIFOQueue(5, [I32, I32], shapes=[[], []], client=client)
    with pytest.raises(InvalidArgumentError, match="Signature mismatch"):
        await q.enqueue([1])
    with pytest.raises(InvalidArgumentError, match="Signature mismatch"):
        await q.enqueue([1, 2, 3])  # TF silently drops the 3rd (issue #13580)
    assert await q.size() == 0


async def test_32_shared_spec_mismatch(client):
    await qps.FIFOQueue(5, I32, shapes=[[]], shared_name="shq", client=client).size()
    with pytest.raises(
        InvalidArgumentError,
        match="Shared queue 'shq' has capacity 5 but requested capacity was 10",
    ):
        await qps.FIFOQueue(10, I32, shapes=[[]], shared_name="shq", client=client).size()
    with pytest.raises(
        InvalidArgumentError,
        match="component types int32 but requested component types were float32",
    ):
        await qps.FIFOQueue(5, np.float32, shapes=[[]], shared_name="shq", client=client).size()
    with pytest.raises(
        InvalidArgumentError,
        match=r"component shapes \[\[\]\] but requested component shapes were \[\[2\]\]",
    ):
        await qps.FIFOQueue(5, I32, shapes=[[2]], shared_name="shq", client=client).size()
    with pytest.raises(InvalidArgumentError, match="expected RandomShuffleQueue, found FIFOQueue"):
        await qps.RandomShuffleQueue(
            5, 0, I32, shapes=[[]], shared_name="shq", client=client
        ).size()


# -- beyond the numbered cases --------------------------------------------------------------


async def test_dtype_rules(client):
    q = qps.FIFOQueue(5, [I32, np.float32], shapes=[[], []], client=client)
    with pytest.raises(InvalidArgumentError, match="expected int32"):
        await q.enqueue([1.5, 1.0])  # a float literal for int32 (TF: TypeError)
    with pytest.raises(InvalidArgumentError, match="expected int32, got int64"):
        await q.enqueue([np.int64(1), 1.0])  # an array of another dtype
    await q.enqueue([1, 2])  # Python int into float32 converts
    a, b = await q.dequeue()
    assert a.dtype == I32 and b.dtype == np.float32 and float(b) == 2.0
    assert await q.size() == 0


async def test_output_formats(client):
    one = fifo(client)
    await one.enqueue(np.int32(4))
    out = await one.dequeue()
    assert isinstance(out, np.ndarray) and out.shape == () and out == 4
    two = qps.FIFOQueue(5, [I32, np.float64], shapes=[[2], []], client=client)
    await two.enqueue_many([np.array([[1, 2], [3, 4]], I32), np.array([0.5, 1.5])])
    x, y = await two.dequeue_many(2)
    assert x.tolist() == [[1, 2], [3, 4]] and y.tolist() == [0.5, 1.5]


async def test_nowait_twins(client):
    q = fifo(client, 2)
    with pytest.raises(WouldBlockError):
        await q.dequeue_nowait()
    await q.enqueue_nowait(1)
    with pytest.raises(WouldBlockError):
        await q.enqueue_many_nowait(np.array([2, 3], I32))  # all or nothing
    assert await q.size() == 1
    await q.enqueue_many_nowait(np.array([2], I32))
    with pytest.raises(WouldBlockError):
        await q.enqueue_nowait(3)
    with pytest.raises(WouldBlockError):
        await q.dequeue_many_nowait(3)
    assert list(await q.dequeue_up_to_nowait(5)) == [1, 2]
    with pytest.raises(WouldBlockError):
        await q.dequeue_up_to_nowait(5)
    await q.close()
    with pytest.raises(OutOfRangeError):
        await q.dequeue_nowait()


async def test_dequeue_timeout_restores_partial_batch(client):
    # qps differs from TF on purpose (§10.2): nothing collected is lost on a timeout.
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    with pytest.raises(DeadlineExceededError):
        await q.dequeue_many(3, timeout=0.3)
    assert await q.size() == 2
    assert list(await q.dequeue_many(2)) == [1, 2]


async def test_cancelled_dequeue_many_restores_partial_batch(client):
    q = fifo(client)
    await q.enqueue_many(np.array([1, 2], I32))
    task = asyncio.create_task(q.dequeue_many(3))
    await until(lambda: _held(q, 2))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await within(task, BOUND, "a cancelled dequeue_many ends")
    s = await q.stats()
    assert s.size == 2 and s.pending_dequeues == 0 and s.held == 0
    assert list(await q.dequeue_many(2)) == [1, 2]


async def test_shared_between_clients_and_wakeup(make_client):
    a = await make_client()
    b = await make_client()
    qa = qps.FIFOQueue(5, np.float32, shapes=[[3]], shared_name="shared", client=a)
    qb = qps.FIFOQueue(5, np.float32, shapes=[[3]], shared_name="shared", client=b)
    waiter = asyncio.create_task(qa.dequeue(timeout=20))
    await until(lambda: _pending_deq(qb, 1))
    await qb.enqueue(np.array([1, 2, 3], np.float32))
    assert (await within(waiter, BOUND, "another client's enqueue wakes the dequeue")).tolist() == [
        1.0,
        2.0,
        3.0,
    ]


async def test_private_queues_are_distinct(client):
    a, b = fifo(client), fifo(client)
    assert a.name != b.name
    await a.enqueue(1)
    assert await b.size() == 0


async def test_containers_isolate(client):
    a = qps.FIFOQueue(5, I32, shared_name="same", container="jobA", client=client)
    b = qps.FIFOQueue(5, I32, shared_name="same", container="jobB", client=client)
    await a.enqueue(1)
    assert await b.size() == 0 and await a.size() == 1


async def test_stats_and_peek(client):
    q = fifo(client, 4, shared_name="st")
    await q.enqueue_many(np.array([5, 6, 7], I32))
    assert [int(x) for x in await q.peek(2)] == [5, 6]
    s = await q.stats()
    assert (s.size, s.enqueued_total, s.dequeued_total, s.closed) == (3, 3, 0, False)
    await q.dequeue()
    s = await q.stats()
    assert (s.size, s.dequeued_total) == (2, 1)
    assert s.as_dict()["type"] == "FIFOQueue"


# -- helpers -----------------------------------------------------------------------------


async def _pending_enq(q, n):
    return (await q.stats()).pending_enqueues == n


async def _pending_deq(q, n):
    return (await q.stats()).pending_dequeues == n


async def _pending_close(q):
    return (await q.stats()).pending_close


async def _held(q, n):
    s = await q.stats()
    return s.pending_dequeues >= 1 and s.held == n


async def test_python_values_convert_only_when_exact(client):
    u8 = qps.FIFOQueue(5, np.uint8, shapes=[[]], client=client)
    await u8.enqueue(5)  # a Python int for an unsigned dtype
    assert int(await u8.dequeue()) == 5
    with pytest.raises(InvalidArgumentError, match="out of range for uint8"):
        await u8.enqueue(-1)
    i32 = qps.FIFOQueue(5, I32, shapes=[[]], client=client)
    with pytest.raises(InvalidArgumentError, match="out of range for int32"):
        await i32.enqueue(2**40)  # would wrap to 0
    with pytest.raises(InvalidArgumentError, match="expected int32"):
        await i32.enqueue(True)
    f16 = qps.FIFOQueue(5, np.float16, shapes=[[]], client=client)
    with pytest.raises(InvalidArgumentError, match="overflows float16"):
        await f16.enqueue(1e6)  # would become inf
    await f16.enqueue(float("inf"))  # an infinity stays one
    assert np.isinf(await f16.dequeue())
    for q in (u8, i32, f16):
        assert await q.size() == 0


async def test_close_queued_behind_a_pending_close_reports_already_closed(client):
    q = fifo(client, 1)
    await q.enqueue(1)
    enq = asyncio.create_task(q.enqueue(2))
    await until(lambda: _pending_enq(q, 1))
    first = asyncio.create_task(q.close())
    await until(lambda: _pending_close(q))
    second = asyncio.create_task(q.close())
    await until(lambda: _ew_len(q, 3))
    await q.dequeue(timeout=BOUND)
    await within(enq, BOUND, "the pending enqueue goes in once there is room")
    await within(first, BOUND, "the first close takes effect")
    with pytest.raises(CancelledError, match="already closed"):
        await within(second, BOUND, "a close queued behind a pending close fails")


async def _ew_len(q, n):
    return len(await q._client.commands.lrange(q._keys[2], 0, -1)) == n


async def test_delivery_records_do_not_pile_up(client):
    q = fifo(client, 5, shared_name="rec")
    for i in range(3):
        await q.enqueue(i)
        await q.dequeue()  # leaves one delivery record, dropped by this object's next dequeue
        await q.enqueue(i)  # an enqueue must not forget to drop it later
        await q.dequeue()
    prefix = qps.keys.queue_prefix("default", "rec")
    records = [k async for k in client.commands.scan_iter(match=prefix + "a:*:h")]
    assert len(records) <= 1


async def _lease_count_consistent(q):
    """The waiter count the fast paths trust equals the lease zset's size."""
    c = q._client.commands
    assert int(await c.hget(q._keys[0], "w") or 0) == await c.zcard(q._keys[4])


async def test_close_wakes_every_blocked_caller(make_client):
    a = await make_client()
    b = await make_client()
    qa = qps.FIFOQueue(1, I32, shapes=[[]], shared_name="wake-all", client=a)
    qb = qps.FIFOQueue(1, I32, shapes=[[]], shared_name="wake-all", client=b)
    waiters = [
        asyncio.create_task(qa.dequeue()),
        asyncio.create_task(qb.dequeue_many(2)),
        asyncio.create_task(qa.dequeue_up_to(3)),
        asyncio.create_task(qb.dequeue()),
    ]
    await until(lambda: _pending_deq(qa, 4))
    await qb.close()
    results = await within(
        asyncio.gather(*waiters, return_exceptions=True), BOUND, "close wakes every blocked caller"
    )
    assert all(isinstance(r, OutOfRangeError) for r in results), results
    s = await qa.stats()
    assert (s.pending_dequeues, s.held, s.size) == (0, 0, 0)


async def test_enqueue_into_a_queue_over_capacity_keeps_every_element(client):
    # Elements given back by a dequeue can leave more than `capacity` stored; an enqueue
    # then waits and must not push out anything already there.
    q = fifo(client, 2)
    await q.enqueue_many(np.array([1, 2], I32))
    many = asyncio.create_task(q.dequeue_many(5))  # holds 1 and 2
    await until(lambda: _held_n(q, 2))
    await q.enqueue_many(np.array([3, 4], I32), timeout=5)  # room again: held ones don't count
    await until(lambda: _held_n(q, 4))  # it took 3 and 4 as well and still waits for a 5th
    many.cancel()  # gives 1..4 back to the front: 4 stored in a capacity-2 queue
    with pytest.raises(asyncio.CancelledError):
        await within(many, BOUND, "a cancelled dequeue_many ends")
    assert await q.size() == 4
    late = asyncio.create_task(q.enqueue(5))
    await until(lambda: _pending_enq(q, 1))
    assert await q.size() == 4
    assert (await q.dequeue_many(4)).tolist() == [1, 2, 3, 4]
    await within(late, BOUND, "an enqueue waiting for room goes in")
    assert int(await q.dequeue()) == 5


async def _held_n(q, n):
    s = await q.stats()
    return s.pending_dequeues == 1 and s.held == n


# -- string components -------------------------------------------------------------------


def test_string_dtype_spellings():
    spellings = ["string", str, bytes, np.bytes_, np.str_, np.dtype("S"), np.dtype("U")]
    spellings += ["S5", "U3", np.dtype("S12"), np.dtype("<U1")]
    for sp in spellings:
        q = qps.FIFOQueue(5, [sp, I32], shapes=[[], []])
        assert q.dtypes == [qps.string, np.dtype(I32)]
    assert qps.string == np.dtype("S") and qps.string.itemsize == 0
    spec = qps.FIFOQueue(5, [str, I32], shapes=[[], []]).spec
    assert '"dtypes":["string","i4"]' in spec.to_json()
    assert qps.QueueSpec.from_json(spec.to_json()) == spec
    assert spec.describe()["dtypes"] == ["string", "int32"]
    with pytest.raises(InvalidArgumentError, match="cannot be sent"):
        qps.FIFOQueue(5, object, shapes=[[]])


async def test_scalar_string_component(client):
    q = qps.FIFOQueue(10, qps.string, shapes=[[]], client=client)
    assert not q._fixed  # widths vary: no fixed-length fast path
    for v in ("hello", b"bytes", np.bytes_(b"x"), np.str_("y"), "", np.array("z"), bytearray(b"w")):
        await q.enqueue(v)
    out = [await q.dequeue() for _ in range(7)]
    assert all(a.shape == () and a.dtype.kind == "S" for a in out)
    assert [a.item() for a in out] == [b"hello", b"bytes", b"x", b"y", b"", b"z", b"w"]
    assert out[0].dtype == np.dtype("S5")


async def test_vector_of_strings(client):
    q = qps.FIFOQueue(10, [qps.string, I32], shapes=[[3], []], client=client)
    await q.enqueue([["a", "bb", "ccc"], 1])
    await q.enqueue([np.array([b"x", b"", b"z"]), 2])
    await q.enqueue([("p", b"q", np.str_("r")), 3])  # a tuple, mixed str and bytes
    with pytest.raises(InvalidArgumentError, match=r"Expected \[3\], got \[2\]"):
        await q.enqueue([["a", "b"], 4])
    s, n = await q.dequeue()
    assert s.dtype == np.dtype("S3") and s.tolist() == [b"a", b"bb", b"ccc"] and int(n) == 1
    s, n = await q.dequeue_many(2)
    assert s.shape == (2, 3) and s.tolist() == [[b"x", b"", b"z"], [b"p", b"q", b"r"]]
    assert n.tolist() == [2, 3]
    empty, _ = await q.dequeue_many(0)
    assert empty.shape == (0, 3) and empty.dtype.kind == "S"


async def test_dequeue_many_of_strings_of_different_lengths(client):
    q = qps.FIFOQueue(10, [qps.string, np.float32], shapes=[[], []], client=client)
    await q.enqueue(["a", 1.0])
    await q.enqueue(["abcdef", 2.0])
    await q.enqueue_many([["", "xy"], np.array([3, 4], np.float32)])
    s, f = await q.dequeue_many(3)
    assert s.dtype == np.dtype("S6") and s.tolist() == [b"a", b"abcdef", b""]
    assert f.tolist() == [1.0, 2.0, 3.0]
    await q.close()
    s, f = await q.dequeue_up_to(5)
    assert s.tolist() == [b"xy"] and f.tolist() == [4.0]


async def test_unicode_strings_are_utf8_encoded(client):
    q = qps.FIFOQueue(10, str, shapes=[[2]], client=client)
    texts = ["héllo", "日本語"]
    await q.enqueue([texts])  # Python str
    await q.enqueue(np.array(texts))  # a NumPy unicode array
    await q.enqueue(np.array(texts, dtype=object))  # an object array of str
    await q.enqueue(np.array([t.encode() for t in texts]))  # already bytes
    out = await q.dequeue_many(4)
    assert out.dtype == np.dtype("S9")  # "日本語" is 9 bytes of UTF-8
    assert [[b.decode("utf-8") for b in row] for row in out.tolist()] == [texts] * 4
    with pytest.raises(InvalidArgumentError, match="UTF-8"):
        await q.enqueue([["\ud800", "x"]])  # a lone surrogate cannot be encoded
    assert await q.size() == 0


async def test_trailing_nul_bytes_are_dropped(client):
    # documented limitation: NumPy bytes arrays drop each string's trailing NULs
    q = qps.FIFOQueue(10, qps.string, shapes=[[2]], client=client)
    await q.enqueue(np.array([b"a\x00", b"\x00b"]))
    assert (await q.dequeue()).tolist() == [b"a", b"\x00b"]


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (1, "got 1"),
        (1.5, "got 1.5"),
        (True, "got True"),
        (None, "got None"),
        (np.int32(3), "got int32"),
        (np.array([1, 2]), "got int64"),
        (np.array([b"a", 1], dtype=object), r"got array\(.*\) \(an item is int\)"),
        (np.array([b"a", [b"b"]], dtype=object), "got an object array holding non-strings"),
        (["a", 1], r"got \['a', 1\] \(an item is int\)"),
        ([["a"], [b"b", 2.5]], r"got .* \(an item is float\)"),
    ],
)
async def test_non_strings_for_a_string_component_are_refused(client, value, got):
    q = qps.FIFOQueue(10, [I32, qps.string], client=client)  # no shapes: any value's shape
    with pytest.raises(
        InvalidArgumentError, match=f"Type mismatch in tuple component 1: expected string, {got}"
    ):
        await q.enqueue([1, value])
    assert await q.size() == 0


async def test_strings_for_a_numeric_component_are_refused(client):
    q = qps.FIFOQueue(10, [np.float32, qps.string], shapes=[[], []], client=client)
    for bad in ("1.5", b"1", np.bytes_(b"2"), np.array("3")):
        with pytest.raises(
            InvalidArgumentError,
            match=r"Type mismatch in tuple component 0: expected float32, got .*string",
        ):
            await q.enqueue([bad, "ok"])
    with pytest.raises(InvalidArgumentError, match="cannot convert"):
        await q.enqueue([1.0, [["a"], ["b", "c"]]])  # ragged
    with pytest.raises(InvalidArgumentError, match="cannot convert"):
        await q.enqueue([1.0, [b"a", [b"b"]]])
    assert await q.size() == 0


async def test_shared_string_queue_dtype_mismatch(client):
    await qps.FIFOQueue(5, [qps.string], shapes=[[]], shared_name="shs", client=client).size()
    # every spelling of the string dtype opens the same queue
    for sp in ("string", str, bytes, np.bytes_, "S5", "U"):
        await qps.FIFOQueue(5, sp, shapes=[[]], shared_name="shs", client=client).size()
    with pytest.raises(
        InvalidArgumentError,
        match="Shared queue 'shs' has component types string but requested component types "
        "were int32",
    ):
        await qps.FIFOQueue(5, I32, shapes=[[]], shared_name="shs", client=client).size()
    await qps.FIFOQueue(
        5, [I32, np.bool_], shapes=[[], []], shared_name="shi", client=client
    ).size()
    with pytest.raises(
        InvalidArgumentError,
        match="has component types int32, bool but requested component types were int32, string",
    ):
        await qps.FIFOQueue(
            5, [I32, "string"], shapes=[[], []], shared_name="shi", client=client
        ).size()


async def test_string_elements_peek_requeue_and_dead_letters(client):
    from qps import keys, wire

    q = qps.FIFOQueue(10, qps.string, shapes=[[]], shared_name="sdl", client=client)
    await q.enqueue("first")
    await q.enqueue("second!")
    assert [p.item() for p in await q.peek(2)] == [b"first", b"second!"]
    many = asyncio.create_task(q.dequeue_many(3))  # holds both, waits for a third
    await until(lambda: _held_n(q, 2))
    many.cancel()  # gives them back, re-encoded from the decoded arrays
    with pytest.raises(asyncio.CancelledError):
        await within(many, BOUND, "a cancelled dequeue_many ends")
    items = keys.queue_prefix("default", "sdl") + "items"
    await client.commands.rpush(items, wire.encode([np.float64(2.5)]))  # not a string
    await q.enqueue("third")
    out = await q.dequeue_many(3)
    assert out.tolist() == [b"first", b"second!", b"third"]
    s = await q.stats()
    assert s.dead_letters == 1 and s.size == 0


async def test_large_string_element_travels_in_chunks(client):
    from qps.queues.large import CHUNK_BYTES

    q = qps.FIFOQueue(2, qps.string, shapes=[[3]], client=client)
    big = np.array([b"a" * (CHUNK_BYTES // 2), b"b", b"c"])  # 3 items of 512 KiB: 1.5 MiB
    await q.enqueue(big)
    await q.enqueue([["x", "y", "z"]])
    out = await q.dequeue_many(2)
    assert out.dtype == big.dtype and out[0].tolist() == big.tolist()
    assert out[1].tolist() == [b"x", b"y", b"z"]


async def test_shuffle_queue_with_strings(client):
    q = qps.RandomShuffleQueue(10, 0, [qps.string, I32], shapes=[[], []], seed=3, client=client)
    words = ["a", "bb", "ccc", "dddd"]
    await q.enqueue_many([words, np.arange(4, dtype=I32)])
    s, n = await q.dequeue_many(4)
    assert sorted(zip(s.tolist(), n.tolist())) == [(w.encode(), i) for i, w in enumerate(words)]
