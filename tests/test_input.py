"""workers/input.py: Coordinator, QueueRunner and the batching helpers, against
docs/input.md and its conformance cases 55-61. Queue tests run on both backends
(fakeredis and a real server); nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Multiset
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import qps
from qps.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    OutOfRangeError,
    WouldBlockError,
)
from tests.conftest import until
from workers.input import (
    Batcher,
    Coordinator,
    QueueRunner,
    batch,
    batch_join,
    shuffle_batch,
    shuffle_batch_join,
    slice_input_producer,
    start_queue_runners,
)

# -- Coordinator ------------------------------------------------------------------------------


async def test_61_out_of_range_is_a_clean_stop() -> None:
    coord = Coordinator()
    assert not coord.should_stop()
    coord.request_stop(OutOfRangeError("end of input"))
    assert coord.should_stop()
    assert await coord.wait_for_stop(0)
    await coord.join()  # no error
    assert coord.joined


async def test_61_first_error_wins_and_join_reraises() -> None:
    coord = Coordinator()
    coord.request_stop(ValueError("first"))
    coord.request_stop(KeyError("second"))
    with pytest.raises(ValueError, match="first"):
        await coord.join()
    # once joined, a new error is raised at once (it would go unreported otherwise)
    with pytest.raises(KeyError):
        coord.request_stop(KeyError("late"))
    coord.request_stop()  # a plain stop is fine


async def test_clean_stop_types_are_configurable() -> None:
    coord = Coordinator(clean_stop_exception_types=(KeyError,))
    coord.request_stop(KeyError("fine"))
    await coord.join()
    coord2 = Coordinator()
    coord2.request_stop(KeyError("an error now"))
    with pytest.raises(KeyError):
        await coord2.join()


async def test_wait_for_stop_and_clear_stop() -> None:
    coord = Coordinator()
    assert await coord.wait_for_stop(0) is False
    waiter = asyncio.create_task(coord.wait_for_stop())
    # one loop turn, not a wait on time: the task runs until it waits on the event (no
    # I/O can hold it back), so one that does not wait is done by now
    await asyncio.sleep(0)
    assert not waiter.done()
    coord.request_stop(ValueError("x"))
    assert await waiter is True
    coord.clear_stop()
    assert not coord.should_stop()
    coord.raise_requested_exception()  # nothing recorded any more
    await coord.join()


async def test_stop_on_exception_records_and_swallows() -> None:
    coord = Coordinator()
    with coord.stop_on_exception():
        raise RuntimeError("boom")
    assert coord.should_stop()
    with pytest.raises(RuntimeError, match="boom"):
        coord.raise_requested_exception()
    with pytest.raises(RuntimeError, match="boom"):
        await coord.join()


async def test_stop_on_exception_out_of_range_is_clean() -> None:
    coord = Coordinator()
    with coord.stop_on_exception():
        raise OutOfRangeError("done")
    assert coord.should_stop()
    await coord.join()


async def test_task_exception_stops_the_others_and_join_reraises() -> None:
    coord = Coordinator()
    stopped = asyncio.Event()

    async def worker() -> None:
        await coord.wait_for_stop()
        stopped.set()

    async def failing() -> None:
        raise ValueError("task failed")

    tasks = [asyncio.create_task(worker()), asyncio.create_task(failing())]
    for t in tasks:
        coord.register_task(t)
    with pytest.raises(ValueError, match="task failed"):
        await coord.join(tasks)
    assert stopped.is_set()


async def test_join_given_tasks_report_their_errors() -> None:
    coord = Coordinator()

    async def failing() -> None:
        raise KeyError("k")

    t = asyncio.create_task(failing())
    with pytest.raises(KeyError):
        await coord.join([t])


async def test_join_returns_when_all_tasks_end_without_stop() -> None:
    coord = Coordinator()

    async def quick() -> int:
        return 1

    t = asyncio.create_task(quick())
    await coord.join([t])
    assert not coord.should_stop()


async def test_61_live_task_after_grace_period() -> None:
    coord = Coordinator()
    never = asyncio.Event()

    async def stubborn() -> None:
        while True:
            try:
                await never.wait()
            except asyncio.CancelledError:
                raise

    t = asyncio.create_task(stubborn(), name="stubborn")
    coord.request_stop()
    with pytest.raises(RuntimeError, match="threads still running: stubborn"):
        await coord.join([t], stop_grace_period_secs=0)
    assert t.cancelled()  # a task, unlike a thread, is cancelled

    coord.clear_stop()
    t2 = asyncio.create_task(stubborn(), name="stubborn2")
    coord.request_stop()
    await coord.join([t2], stop_grace_period_secs=0, ignore_live_threads=True)
    assert t2.cancelled()


# -- QueueRunner --------------------------------------------------------------------------------


def _fifo(client: qps.Client, capacity: int = 10, **kw: Any) -> qps.FIFOQueue:
    return qps.FIFOQueue(capacity, [np.int64], shapes=[[]], client=client, **kw)


def _ends_after(values: list[int]) -> Any:
    """An enqueue-op factory: each call takes the next value; OutOfRange at the end."""
    it = iter(values)

    def take() -> int:
        try:
            return next(it)
        except StopIteration:
            raise OutOfRangeError("Reached limit") from None

    return take


async def test_60_runner_closes_queue_when_upstream_ends(client: qps.Client) -> None:
    q = _fifo(client)
    take = _ends_after([1, 2, 3])

    async def op() -> None:
        await q.enqueue(np.int64(take()))

    runner = QueueRunner(q, [op, op])
    coord = Coordinator()
    tasks = runner.start(coord)
    assert len(tasks) == 3  # 2 enqueue tasks + close_on_stop
    await until(q.is_closed)
    assert await q.size() == 3
    got = sorted(int(v) for v in await q.dequeue_many(3))
    assert got == [1, 2, 3]
    with pytest.raises(OutOfRangeError):
        await q.dequeue()
    assert runner.exceptions_raised == []
    coord.request_stop()
    await coord.join(tasks)


async def test_59_runner_error_reraised_by_join_and_queue_closed(client: qps.Client) -> None:
    q = _fifo(client)
    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise InvalidArgumentError("CheckNumerics: NaN")
        await q.enqueue(np.int64(calls))

    coord = Coordinator()
    tasks = QueueRunner(q, [op]).start(coord)
    with pytest.raises(InvalidArgumentError, match="NaN"):
        await coord.join(tasks)
    assert await q.is_closed()  # by the cancel op
    assert [int(v) for v in await q.dequeue_up_to(5)] == [1, 2]


async def test_runner_without_coordinator_records_exceptions(client: qps.Client) -> None:
    q = _fifo(client)

    async def op() -> None:
        raise ValueError("no coord")

    runner = QueueRunner(q, [op])
    (task,) = runner.start()
    with pytest.raises(ValueError, match="no coord"):
        await task
    assert [type(e) for e in runner.exceptions_raised] == [ValueError]
    assert not await q.is_closed()


async def test_runner_cancelled_by_request_stop(client: qps.Client) -> None:
    """Blocked on a full queue: the stop runs the cancel op (close with cancel), the
    pending enqueue fails, join completes without error and the stored elements stay."""
    q = _fifo(client, capacity=2)
    n = 0

    async def op() -> None:
        nonlocal n
        n += 1
        await q.enqueue(np.int64(n))

    coord = Coordinator()
    runner = QueueRunner(q, [op])
    tasks = runner.start(coord)
    assert runner.start(coord) == []  # already running
    await until(lambda: _stats_pending(q))
    coord.request_stop()
    await coord.join(tasks, stop_grace_period_secs=30)
    assert await q.is_closed()
    assert [int(v) for v in await q.dequeue_up_to(5)] == [1, 2]
    assert not runner.running()


async def _stats_pending(q: qps.FIFOQueue) -> bool:
    s = await q.stats()
    return s.size == q.capacity and s.pending_enqueues == 1


async def test_runner_waiting_on_its_input_is_cancelled_by_stop(client: qps.Client) -> None:
    q = _fifo(client)
    never, waiting = asyncio.Event(), asyncio.Event()

    async def op() -> None:
        waiting.set()
        await never.wait()  # an input that never comes

    coord = Coordinator()
    tasks = QueueRunner(q, [op]).start(coord)
    await asyncio.wait_for(waiting.wait(), 10)  # the runner waits on its input
    coord.request_stop()
    await coord.join(tasks, stop_grace_period_secs=30)  # no RuntimeError: cancelled
    assert all(t.done() for t in tasks)
    assert await q.is_closed()


def test_runner_argument_checks() -> None:
    q = qps.FIFOQueue(1, [np.int64], shapes=[[]])
    with pytest.raises(TypeError):
        QueueRunner(q, [], queue_closed_exception_types=[OutOfRangeError])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QueueRunner(q, [], queue_closed_exception_types=(int,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QueueRunner(None, [])
    r = QueueRunner(q, [])
    assert r.queue is q and r.queue_closed_exception_types == (OutOfRangeError,)


# -- batch / shuffle_batch / batch_join ------------------------------------------------------


async def _drain(b: Batcher) -> list[Any]:
    return [x async for x in b]


async def _run_to_end(b: Batcher) -> list[Any]:
    coord = Coordinator()
    tasks = b.start(coord)
    try:
        out = await _drain(b)
    finally:
        coord.request_stop()
    await coord.join(tasks, stop_grace_period_secs=30)
    return out


@pytest.mark.parametrize("smaller", [False, True])
async def test_55_batch_end_of_input(client: qps.Client, smaller: bool) -> None:
    src = slice_input_producer([np.array(list("abcde"))], num_epochs=2, shuffle=False)
    b = batch(src, 3, allow_smaller_final_batch=smaller, client=client)
    out = [b"".join(x.tolist()).decode() for x in await _run_to_end(b)]
    assert out == (["abc", "dea", "bcd", "e"] if smaller else ["abc", "dea", "bcd"])
    with pytest.raises(OutOfRangeError):
        await b.get()


def _examples(n: int) -> list[tuple[np.ndarray, np.int64]]:
    return [(np.full(4, i, np.float32), np.int64(i)) for i in range(n)]


async def test_batch_every_example_once_with_shapes(client: qps.Client) -> None:
    b = batch(_examples(20), 5, num_threads=3, capacity=4, client=client)
    out = await _run_to_end(b)
    assert len(out) == 4
    for x, y in out:
        assert x.shape == (5, 4) and x.dtype == np.float32
        assert y.shape == (5,) and y.dtype == np.int64
        assert (x[:, 0].astype(np.int64) == y).all()
    assert sorted(int(v) for _, y in out for v in y) == list(range(20))
    assert b.queue is not None and b.queue.capacity == 4


async def test_batch_allow_smaller_final_batch(client: qps.Client) -> None:
    b = batch(_examples(7), 3, allow_smaller_final_batch=True, client=client)
    sizes = [len(y) for _, y in await _run_to_end(b)]
    assert sizes == [3, 3, 1]


async def test_batch_without_smaller_final_batch_leaves_the_rest(client: qps.Client) -> None:
    b = batch(_examples(7), 3, client=client)
    sizes = [len(y) for _, y in await _run_to_end(b)]
    assert sizes == [3, 3]
    assert b.queue is not None and await b.queue.size() == 1  # left, as in TF


async def test_batch_dict_examples_and_explicit_spec(client: qps.Client) -> None:
    async def gen() -> AsyncIterator[dict[str, Any]]:
        for i in range(6):
            yield {"x": np.full(2, i, np.float32), "y": i}

    b = batch(
        gen(), 2, dtypes=[np.float32, np.int32], shapes=[[2], []], names=["x", "y"],
        client=client,
    )  # fmt: skip
    assert b.queue is not None  # spec known: created at once
    out = await _run_to_end(b)
    assert [sorted(d) for d in out] == [["x", "y"]] * 3
    assert out[0]["y"].dtype == np.int32
    assert sorted(int(v) for d in out for v in d["y"]) == list(range(6))


async def test_batch_enqueue_many_chunks(client: qps.Client) -> None:
    chunks = [[np.arange(i, i + 4, dtype=np.int64)] for i in range(0, 12, 4)]
    b = batch(chunks, 6, enqueue_many=True, client=client)
    out = await _run_to_end(b)
    assert [x.tolist() for x in out] == [list(range(6)), list(range(6, 12))]


async def test_batch_dynamic_pad(client: qps.Client) -> None:
    seqs = [[np.arange(n, dtype=np.int32) + 1] for n in (3, 1, 2, 2)]
    b = batch(seqs, 2, dynamic_pad=True, client=client)
    out = await _run_to_end(b)
    assert isinstance(b.queue, qps.PaddingFIFOQueue)
    assert [x.tolist() for x in out] == [[[1, 2, 3], [1, 0, 0]], [[1, 2], [1, 2]]]


async def test_batch_of_an_empty_source(client: qps.Client) -> None:
    b = batch([], 2, client=client)
    out = await _run_to_end(b)
    assert out == [] and b.queue is None
    with pytest.raises(OutOfRangeError):
        await b.get()


async def test_source_error_propagates_to_join(client: qps.Client) -> None:
    async def gen() -> AsyncIterator[list[np.ndarray]]:
        yield [np.int64(1)]
        raise RuntimeError("bad record")

    b = batch(gen(), 1, client=client)
    coord = Coordinator()
    tasks = b.start(coord)
    with pytest.raises(RuntimeError, match="bad record"):
        await coord.join(tasks)
    # the cancel op closed the queue: what was stored drains, then OutOfRange
    assert [int(v) for v in await b.get()] == [1]
    with pytest.raises(OutOfRangeError):
        await b.get()


async def test_batch_from_an_upstream_queue(client: qps.Client) -> None:
    """A two-stage pipeline: a runner fills an upstream queue, batch() reads its
    dequeue; the end of the upstream closes the batch queue."""
    up = qps.FIFOQueue(3, [np.int64, np.float32], shapes=[[], [2]], client=client)
    take = _ends_after(list(range(10)))

    async def fill() -> None:
        i = take()
        await up.enqueue([np.int64(i), np.full(2, i, np.float32)])

    b = batch(up, 4, allow_smaller_final_batch=True, client=client)
    assert b.queue is not None  # dtypes and shapes come from the upstream queue
    coord = Coordinator()
    tasks = start_queue_runners(coord, [QueueRunner(up, [fill]), b])
    try:
        out = await _drain(b)
    finally:
        coord.request_stop()
    await coord.join(tasks, stop_grace_period_secs=30)
    assert [len(y) for y, _ in out] == [4, 4, 2]
    assert [int(v) for y, _ in out for v in y] == list(range(10))


async def test_57_shuffle_batch_capacity_must_exceed_min(client: qps.Client) -> None:
    with pytest.raises(ValueError, match=r"capacity 5 must be bigger than min_after_dequeue 5\."):
        shuffle_batch(_examples(1), 1, capacity=5, min_after_dequeue=5, client=client)
    with pytest.raises(InvalidArgumentError):
        shuffle_batch_join([_examples(1)], 1, capacity=2, min_after_dequeue=3, client=client)


async def test_shuffle_batch_every_example_once(client: qps.Client) -> None:
    b = shuffle_batch(
        _examples(40), 8, capacity=16, min_after_dequeue=6, num_threads=2, seed=3,
        client=client,
    )  # fmt: skip
    out = await _run_to_end(b)
    assert isinstance(b.queue, qps.RandomShuffleQueue)
    assert b.queue.spec.min_after_dequeue == 6 and b.queue.capacity == 16
    ys = [int(v) for _, y in out for v in y]
    assert sorted(ys) == list(range(40)) and len(out) == 5
    assert ys != list(range(40))  # shuffled (a fixed seed; 40! orders)


async def test_shuffle_batch_keeps_min_after_dequeue_until_closed(client: qps.Client) -> None:
    release = asyncio.Event()

    async def gen() -> AsyncIterator[list[Any]]:
        for i in range(8):
            yield [np.int64(i)]
        await release.wait()  # the input pauses here, then ends

    b = shuffle_batch(gen(), 2, capacity=20, min_after_dequeue=5, seed=1, client=client)
    coord = Coordinator()
    tasks = b.start(coord)
    try:
        await until(lambda: _size_is(b, 8))  # the queue is made from the first example
        q = b.queue
        assert isinstance(q, qps.RandomShuffleQueue)
        first = await b.get()
        assert len(first) == 2 and await q.size() == 6
        await q.dequeue_nowait()  # 6 > 5: one may go
        with pytest.raises(WouldBlockError):  # 5 stored = min_after_dequeue: held back
            await q.dequeue_nowait()
        assert await b.fraction_full() == 0.0
        release.set()  # end of input: the runner closes the queue, which lifts the limit
        rest = [x async for x in b]
        assert [len(x) for x in rest] == [2, 2]  # 1 left: no full batch
        assert await q.size() == 1 and await q.is_closed()
    finally:
        coord.request_stop()
        await coord.join(tasks, stop_grace_period_secs=30)


async def _size_is(b: Batcher, n: int) -> bool:
    return await b.size() == n


async def test_58_batch_join_mixes_sources(client: qps.Client) -> None:
    a = [[np.int64(i)] for i in range(0, 10)]
    c = [[np.int64(i)] for i in range(100, 107)]
    b = batch_join([a, c], 4, allow_smaller_final_batch=True, client=client)
    assert len(b.queue_runner.enqueue_ops) == 2
    out = await _run_to_end(b)
    got = Multiset(int(v) for x in out for v in x)
    assert got == Multiset(list(range(10)) + list(range(100, 107)))


async def test_shuffle_batch_join_every_example_once(client: qps.Client) -> None:
    a = _examples(10)
    c = [(np.full(4, i, np.float32), np.int64(i)) for i in range(10, 15)]
    b = shuffle_batch_join([a, c], 5, capacity=8, min_after_dequeue=2, seed=0, client=client)
    out = await _run_to_end(b)
    assert sorted(int(v) for _, y in out for v in y) == list(range(15))


async def test_shared_batch_queue_visible_to_other_clients(make_client: Any) -> None:
    c1 = await make_client()
    c2 = await make_client()
    b = batch(_examples(6), 3, shared_name="shared_batches", client=c1)
    coord = Coordinator()
    tasks = b.start(coord)
    try:
        await until(lambda: _size_is(b, 6))
        other = await qps.Session(client=c2).open()
        q2 = await other.queue("shared_batches")  # another process would do this
        _, y = await q2.dequeue_many(3)
        _, y2 = await b.get()
        assert sorted(y.tolist() + y2.tolist()) == list(range(6))
    finally:
        coord.request_stop()
        await coord.join(tasks, stop_grace_period_secs=30)


async def test_get_timeout_before_any_example(client: qps.Client) -> None:
    b = batch(_examples(3), 2, client=client)  # not started: no example, no queue
    with pytest.raises(DeadlineExceededError):
        await b.get(timeout=0)


async def test_get_after_client_close_raises_cancelled(make_client: Any) -> None:
    c = await make_client()
    b = batch([], 1, dtypes=[np.int64], shapes=[[]], client=c)
    assert b.queue is not None
    getter = asyncio.create_task(b.get())
    await until(lambda: _pending_dequeues(b))
    await c.close()
    with pytest.raises(CancelledError):
        await getter


async def _pending_dequeues(b: Batcher) -> bool:
    assert b.queue is not None
    return (await b.queue.stats()).pending_dequeues == 1


def test_slice_input_producer_checks() -> None:
    with pytest.raises(ValueError, match=r"num_epochs must be > 0 not 0\."):
        slice_input_producer([np.arange(3)], num_epochs=0)
    with pytest.raises(InvalidArgumentError):
        slice_input_producer([np.arange(3), np.arange(4)])
    with pytest.raises(InvalidArgumentError):
        batch(_examples(1), 0)
    with pytest.raises(TypeError):
        batch(42, 1)


async def test_slice_input_producer_epochs_are_permutations() -> None:
    got = [int(x[0]) async for x in slice_input_producer([np.arange(5)], num_epochs=3, seed=2)]
    assert len(got) == 15
    for e in range(3):
        assert sorted(got[e * 5 : (e + 1) * 5]) == list(range(5))
