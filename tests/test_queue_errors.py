"""Bad input gets a clear error and leaves the queue unchanged; corrupt bytes written
into a queue's keys by another client are set aside and nothing else is lost."""

from __future__ import annotations

import re

import msgpack
import numpy as np
import pytest

import qps
from qps import keys, wire
from qps.errors import DataLossError, InvalidArgumentError, QpsError
from qps.queues.inspect import scan_queues
from qps.queues.spec import MAX_COUNT
from tests.conftest import until


async def _items(client, q):
    return keys.queue_prefix(q.container, q.name) + "items"


@pytest.mark.parametrize(
    "bad",
    [
        [np.zeros(3, np.float64)],  # wrong dtype
        [np.zeros(4, np.float32)],  # wrong shape
        [np.zeros(3, np.float32), 1],  # wrong arity
        [["a", "b", "c"]],  # strings for a float32 component
        [np.array([b"1", b"2", b"3"])],  # a bytes array for a float32 component
    ],
)
async def test_bad_input_leaves_queue_unchanged(client, bad):
    q = qps.FIFOQueue(5, np.float32, shapes=[[3]], client=client)
    await q.enqueue(np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError):
        await q.enqueue(bad)
    with pytest.raises(InvalidArgumentError):
        await q.enqueue_many([np.stack([b] * 2) if isinstance(b, np.ndarray) else b for b in bad])
    s = await q.stats()
    assert (s.size, s.enqueued_total) == (1, 1)


async def test_garbage_in_items_is_quarantined(client):
    q = qps.FIFOQueue(10, np.int32, shapes=[[]], shared_name="g", client=client)
    await q.enqueue(1)
    items = await _items(client, q)
    await client.commands.rpush(items, b"\x00garbage not a qps message")
    await client.commands.rpush(items, wire.encode([np.float64(2.5)]))  # valid bytes, wrong spec
    await q.enqueue_many(np.array([3, 4], np.int32))
    # the consumer reports the bad ones and moves on: it still gets 3 good elements
    assert (await q.dequeue_many(3)).tolist() == [1, 3, 4]
    s = await q.stats()
    assert s.dead_letters == 2 and s.size == 0
    dlq = await client.commands.lrange(keys.queue_prefix("default", "g") + "dlq", 0, -1)
    records = [msgpack.unpackb(r, raw=False) for r in dlq]
    assert records[0]["data"] == b"\x00garbage not a qps message"
    assert "magic" in records[0]["reason"]
    assert "float64" in records[1]["reason"]


async def test_garbage_single_dequeue_moves_on(client):
    q = qps.FIFOQueue(10, np.int32, shared_name="g1", client=client)
    items = await _items(client, q)
    await q.size()
    await client.commands.rpush(items, b"QW\x01\x00\xff\xff\xff\xff truncated")
    await q.enqueue(7)
    assert int(await q.dequeue()) == 7
    assert (await q.stats()).dead_letters == 1


async def test_large_elements_travel_in_chunks(client):
    from qps.queues.large import CHUNK_BYTES

    n = (3 * CHUNK_BYTES) // 4 + 1000  # float32: ~3 MiB, 4 chunks
    q = qps.FIFOQueue(1, [np.float32, np.int64], shapes=[[n], []], shared_name="big", client=client)
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    await q.enqueue([x, 5])
    prefix = keys.queue_prefix("default", "big")
    chunk_keys = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    assert len(chunk_keys) == 4
    assert [await client.commands.ttl(k) for k in chunk_keys] == [-1] * 4  # stored: never expire
    [(peeked, _)] = await q.peek()  # read without consuming: chunks stay
    assert np.array_equal(peeked, x) and await client.commands.exists(*chunk_keys) == 4
    y, label = await q.dequeue()
    assert np.array_equal(x, y) and int(label) == 5
    assert await client.commands.exists(*chunk_keys) == 0  # consumer deleted them
    # a batch of large elements through enqueue_many / dequeue_many
    q2 = qps.FIFOQueue(4, np.float32, shapes=[[n]], shared_name="big2", client=client)
    xs = np.stack([x, -x, x * 2])
    await q2.enqueue_many(xs)
    assert np.array_equal(await q2.dequeue_many(3), xs)


async def test_missing_chunks_are_reported_and_skipped(client):
    from qps.queues.large import CHUNK_BYTES

    n = CHUNK_BYTES // 2
    q = qps.FIFOQueue(5, np.float32, shapes=[[n]], shared_name="big3", client=client)
    await q.enqueue(np.ones(n, np.float32))
    await q.enqueue(np.zeros(n, np.float32))
    prefix = keys.queue_prefix("default", "big3")
    first = (await client.commands.lrange(prefix + "items", 0, 0))[0].decode().split("|")[1]
    await client.commands.delete(f"{prefix}b:{first}:0")
    assert not np.any(await q.dequeue())  # the damaged first element is set aside
    assert (await q.stats()).dead_letters == 1


async def test_held_large_elements_keep_their_chunks(client):
    from qps.queues.large import CHUNK_BYTES

    n = CHUNK_BYTES // 2  # 2 MiB of float32: 2 chunks (+ header)
    q = qps.FIFOQueue(5, np.float32, shapes=[[n]], shared_name="held", client=client)
    await q.enqueue(np.ones(n, np.float32))
    import asyncio

    task = asyncio.create_task(q.dequeue_many(2))  # holds the first, waits for a second
    prefix = keys.queue_prefix("default", "held")

    async def holds_one() -> bool:
        return (await q.stats()).held == 1

    await until(holds_one, what="the dequeue_many holds the first element")
    chunk_keys = [k async for k in client.commands.scan_iter(match=prefix + "b:*")]
    assert chunk_keys and [await client.commands.pttl(k) for k in chunk_keys] == [-1] * len(
        chunk_keys
    )
    await q.enqueue(np.zeros(n, np.float32))
    out = await task
    assert out.shape == (2, n) and out[0].all() and not out[1].any()


async def test_unreachable_server_is_unavailable_error():
    from qps.errors import UnavailableError

    with pytest.raises(
        UnavailableError, match=r"cannot reach Redis at redis://u:\*\*\*@127\.0\.0\.1:1"
    ) as info:
        await qps.connect("redis://u:secret@127.0.0.1:1/0")
    assert "secret" not in str(info.value)
    assert str(info.value).count("unreachable") <= 1


async def test_elements_that_only_look_like_the_spec_are_set_aside(client):
    """One-element dequeues of a fixed numeric spec take a quick path for bytes that are
    exactly an element of the spec (its header, then its bytes); anything else, even
    with that header in front, still goes through the checking decoder."""
    q = qps.FIFOQueue(10, np.float32, shapes=[[4]], shared_name="look", client=client)
    good = wire.encode([np.arange(4, dtype=np.float32)])
    header = good[: len(good) - 16]
    items = await _items(client, q)
    await q.size()
    await client.commands.rpush(items, header + b"\x00" * 15)  # one byte short
    await client.commands.rpush(items, header + b"\x00" * 17)  # one byte over
    await client.commands.rpush(items, wire.encode([np.zeros(4, np.int32)]))  # same length
    await client.commands.rpush(items, good)
    got = await q.dequeue()
    assert got.dtype == np.float32 and got.shape == (4,) and got.tolist() == [0, 1, 2, 3]
    s = await q.stats()
    assert s.dead_letters == 3 and s.size == 0


@pytest.mark.parametrize(
    "value",
    [
        np.arange(8, dtype=np.float32)[::2],  # not contiguous
        np.asfortranarray(np.arange(4, dtype=np.float32).reshape(2, 2)).reshape(4),
        np.arange(4, dtype=np.float32),
    ],
)
async def test_one_element_round_trips_stored_as_the_wire_format(client, value):
    q = qps.FIFOQueue(4, np.float32, shapes=[[4]], client=client)
    await q.enqueue(value)
    items = await _items(client, q)
    stored = await client.commands.lindex(items, 0)
    assert stored == wire.encode([np.ascontiguousarray(value)])  # what any reader decodes
    got = await q.dequeue()
    assert got.dtype == np.float32 and got.tolist() == value.tolist()


async def test_a_byte_swapped_array_is_refused_as_before(client):
    q = qps.FIFOQueue(4, np.float32, shapes=[[4]], client=client)
    with pytest.raises(InvalidArgumentError, match="Type mismatch"):
        await q.enqueue(np.zeros(4, ">f4"))
    assert await q.size() == 0


# -- issue 32: hostile stored state and bounds --------------------------------------------


async def test_poison_reference_is_quarantined_and_the_queue_moves_on(client):
    """A large-element reference with negative counts was taken for one (ValueError
    from the buffer pool, the element back at the head, every dequeue failing)."""
    q = qps.FIFOQueue(10, np.int32, shapes=[[]], shared_name="poison", container="C", client=client)
    await q.enqueue_many(np.array([1, 2], np.int32))
    items = keys.queue_prefix("C", "poison") + "items"
    await client.commands.lset(items, 0, b"QR|zz.1.0|-3|-5")
    assert int(await q.dequeue()) == 2
    [record] = await client.commands.lrange(keys.queue_prefix("C", "poison") + "dlq", 0, -1)
    record = msgpack.unpackb(record)
    assert record["data"] == b"QR|zz.1.0|-3|-5" and "malformed" in record["reason"]


async def test_reference_to_billions_of_chunks_does_not_stall_the_server(client):
    q = qps.FIFOQueue(10, np.int32, shapes=[[]], shared_name="huge", client=client)
    await q.enqueue(1)
    await client.commands.rpush(await _items(client, q), b"QR|zz.1.0|99999999999|5")
    await q.enqueue(3)
    assert (await q.dequeue_many(2)).tolist() == [1, 3]
    assert (await q.stats()).dead_letters == 1


@pytest.mark.parametrize("spec", [None, b"{not json", b'{"kind":"fifo"}'])
async def test_corrupt_spec_is_a_data_loss_error_naming_the_key(client, spec):
    q = qps.FIFOQueue(10, np.int32, shared_name="m", container="C", client=client)
    await q.enqueue(1)
    meta = keys.queue_prefix("C", "m") + "meta"
    if spec is None:
        await client.commands.hdel(meta, "spec")
    else:
        await client.commands.hset(meta, "spec", spec)
    with pytest.raises(DataLossError, match=re.escape(meta)):
        await q.stats()
    again = qps.FIFOQueue(10, np.int32, shared_name="m", container="C", client=client)
    with pytest.raises(DataLossError, match=re.escape(meta)):
        await again.size()
    ok = qps.FIFOQueue(10, np.int32, shared_name="ok", container="C", client=client)
    await ok.enqueue(2)
    listed = await scan_queues(client, "C")
    assert [type(s).__name__ for s in listed] == ["BrokenQueue", "QueueStats"]
    assert meta in listed[0].error and listed[1].size == 1


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("fifo", "x", -100), ("shuffle", "n", 100), ("shuffle", "n", -1), ("fifo", "cap", "abc")],
)
async def test_counters_out_of_range_are_refused(client, kind, field, value):
    """size() answered -95 for x = -100; a shuffle queue with n = 100 blocked its
    enqueues, with n = -1 timed out its dequeues, holding 5 elements."""
    if kind == "fifo":
        q = qps.FIFOQueue(10, np.int32, shapes=[[]], shared_name="k", client=client)
    else:
        q = qps.RandomShuffleQueue(10, 0, np.int32, shapes=[[]], shared_name="k", client=client)
    await q.enqueue_many(np.arange(5, dtype=np.int32))
    meta = keys.queue_prefix("default", "k") + "meta"
    await client.commands.hset(meta, field, value)
    calls = [q.stats, lambda: q.enqueue(7, timeout=5)]
    if field != "cap":  # the size and a dequeue do not depend on it
        calls += [q.size, lambda: q.dequeue(timeout=5)]
    for call in calls:
        with pytest.raises(DataLossError, match=re.escape(meta)):
            await call()


@pytest.mark.parametrize("capacity", [2**63, 2**53 + 1, 2.5])
def test_capacity_beyond_what_lua_holds_is_refused(capacity):
    with pytest.raises(InvalidArgumentError):
        qps.FIFOQueue(capacity, np.int32)


async def test_counts_beyond_the_bound_are_invalid_arguments(client):
    q = qps.FIFOQueue(10, np.int32, shapes=[[]], client=client)
    for call in (q.dequeue_many, q.dequeue_up_to, q.dequeue_ready_acked):
        with pytest.raises(InvalidArgumentError, match="the most is"):
            await call(2**63)
    assert MAX_COUNT == 2**53 - 1
    with pytest.raises(InvalidArgumentError):
        await q.dequeue_many(MAX_COUNT + 1)


@pytest.mark.parametrize("key", ["abc", "qps:{C/v/x}:meta", "qps:{C/q/x}:items", "dlq"])
async def test_queue_scripts_refuse_keys_of_no_queue(client, key):
    """quarantine.lua derived its prefix from any key: called with 'abc' it created
    'abc' and 'dlq' outside the qps namespace."""
    for script in ("quarantine", "enqueue", "dequeue", "release", "ack"):
        with pytest.raises(QpsError, match="a queue script takes one key"):
            await client.run_script(script, [key], ["10000 x", b"record"])
    assert await client.commands.keys("*") == []
