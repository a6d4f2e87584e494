"""Receive buffers reused across reads of large values (qps/buffers.py): a buffer comes
back only once nothing refers to it, so a value a caller keeps is never overwritten; a
queue's large elements and a PS shard's large gradient messages are read into reused
buffers, and a shard lets go of a message's bytes once it is applied."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import fakeredis
import numpy as np
import pytest

import qps
from qps import buffers
from qps.optimizers import SGD
from qps.ps import control
from qps.ps import shard as shard_module
from qps.ps.shard import Shard, ShardOptions
from tests.conftest import ClientFactory

MIB = 1 << 20


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[buffers.BufferPool]:
    """A fresh process pool for the test."""
    p = buffers.BufferPool()
    monkeypatch.setattr(buffers, "_POOL", p)
    yield p


def test_a_buffer_comes_back_only_when_nothing_refers_to_it() -> None:
    p = buffers.BufferPool(limit=64 * MIB)
    first = p.take(2 * MIB)
    arr = np.frombuffer(first, np.float32)[5:]  # a view of it, as a decoded value is
    del first
    second = p.take(2 * MIB)  # the first is still referred to (by arr)
    assert (p.fresh, p.reused) == (2, 0)
    del arr, second
    third = p.take(2 * MIB)
    assert (p.fresh, p.reused) == (2, 1)
    assert len(third) == 2 * MIB and not third.readonly
    other = p.take(3 * MIB)  # sizes match exactly
    assert (p.fresh, p.reused) == (3, 1)
    assert p.nbytes == 7 * MIB
    del third, other


def test_small_buffers_are_not_pooled_and_the_limit_holds() -> None:
    p = buffers.BufferPool(limit=5 * MIB)
    small = p.take(1000)
    assert len(small) == 1000 and p.nbytes == 0
    held = [p.take(2 * MIB) for _ in range(4)]  # all lent: only two fit in the pool
    assert p.nbytes == 4 * MIB and p.fresh == 4
    del held
    a = p.take(3 * MIB)  # idle 2 MiB buffers make room for it
    assert p.nbytes <= 5 * MIB
    b = p.take(3 * MIB)  # the pooled one is lent: a plain buffer, over the limit
    assert p.nbytes <= 5 * MIB
    del a, b
    p.clear()
    assert p.nbytes == 0


async def test_dequeued_large_elements_keep_their_values(
    make_client: ClientFactory, pool: buffers.BufferPool
) -> None:
    client = await make_client()
    real = not isinstance(client.commands, fakeredis.FakeAsyncRedis)
    q = qps.FIFOQueue(8, np.float64, shapes=[[300_000]], shared_name="bufs", client=client)
    values = [np.full(300_000, float(k)) for k in range(4)]  # 2.4 MB: out of line
    for v in values:
        await q.enqueue(v)
    kept = await q.dequeue()  # kept while the next ones are read
    dropped = await q.dequeue()
    np.testing.assert_array_equal(dropped, values[1])
    del dropped
    third = await q.dequeue()  # read into the buffer of the second, if pooled
    fourth = await q.dequeue()
    np.testing.assert_array_equal(kept, values[0])
    np.testing.assert_array_equal(third, values[2])
    np.testing.assert_array_equal(fourth, values[3])
    if real:  # fakeredis has no lean connection: its replies are its own buffers
        assert pool.reused >= 1 and pool.fresh == 3


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[qps.Client]:
    yield await make_client()


async def test_a_shard_lets_go_of_applied_messages(
    client: qps.Client, pool: buffers.BufferPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One open group of 10 large messages, read one ahead: their buffers are reused
    while the group stays open, and the sum applied is exact."""
    real = not isinstance(client.commands, fakeredis.FakeAsyncRedis)
    monkeypatch.setattr(shard_module, "READ_AHEAD_BYTES", 1)  # one message ahead
    container, n, size = "bufs", 10, 200_000
    await control.configure(client, container, 1, SGD(learning_rate=1.0), queue_capacity=16)
    async with qps.Session(client=client, container=container, worker="w0") as s:
        await s.variable("w", (size,), np.float64, initializer="zeros").create()
        await control.place_variables(client, container, ["w"])
        for k in range(n):
            await s.push({"w": np.full(size, float(k + 1))}, step=k)
    await control.mark_finished(client, container)
    shard = Shard(client, ShardOptions(0, 1, container=container, commit_interval_ms=60_000))
    assert await shard.run() == "finished"
    assert shard.applied == n
    fresh, reused = pool.fresh, pool.reused
    async with qps.Session(client=client, container=container) as s:
        got = (await s.pull("w")).value
    np.testing.assert_array_equal(got, np.full(size, -float(n * (n + 1) // 2)))
    if real:
        assert fresh + reused == n
        assert fresh <= 4, (fresh, reused)  # not one per message held


async def test_large_variable_reads_keep_earlier_values(
    client: qps.Client, pool: buffers.BufferPool
) -> None:
    """Reads of a 2 MiB variable go into reused buffers; a value the caller keeps is
    never the buffer of a later read."""
    real = not isinstance(client.commands, fakeredis.FakeAsyncRedis)
    v = qps.Variable("big", (512, 512), np.float64, initializer="zeros", client=client)
    await v.create()
    kept = []
    for version in range(1, 5):
        await v.publish(np.full((512, 512), float(version)), version, 0)
        got = await v.read()
        assert got.version == version
        if version % 2:
            kept.append((version, got.value))  # the others are dropped at once
        del got
    for version, value in kept:
        np.testing.assert_array_equal(value, np.full((512, 512), float(version)))
    value = (await v.read()).value
    value[0, 0] = -1.0  # the caller's own copy: writable, changes nothing stored
    assert (await v.read()).value[0, 0] == 4.0
    if real:  # the buffers of versions 2 and 4 were read into again
        assert pool.reused >= 2 and pool.fresh <= 4, (pool.fresh, pool.reused)
