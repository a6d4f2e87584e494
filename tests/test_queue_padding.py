"""PaddingFIFOQueue: docs/queues.md and conformance cases 40-43."""

from __future__ import annotations

import numpy as np
import pytest

import qps
from qps.errors import InvalidArgumentError, OutOfRangeError


def padq(client, **kw):
    return qps.PaddingFIFOQueue(
        10, [np.int32, np.float32, np.bool_], shapes=[[None], [None, 2], []], client=client, **kw
    )


async def test_40_dequeue_many_pads_to_batch_maximum(client):
    q = padq(client)
    await q.enqueue([np.array([1, 2, 3], np.int32), np.ones((1, 2), np.float32), True])
    await q.enqueue([np.array([4], np.int32), np.ones((3, 2), np.float32), False])
    a, b, c = await q.dequeue_many(2)
    assert a.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert b.shape == (2, 3, 2)
    assert b[0].tolist() == [[1, 1], [0, 0], [0, 0]] and b[1].tolist() == [[1, 1]] * 3
    assert c.tolist() == [True, False] and c.dtype == np.bool_


async def test_40_string_component_pads_with_empty_bytes(client):
    # the exact case 40: [int32, string, float32, bool] with shapes [[None],[None],[None,2],[]]
    q = qps.PaddingFIFOQueue(
        10,
        [np.int32, qps.string, np.float32, np.bool_],
        shapes=[[None], [None], [None, 2], []],
        client=client,
    )
    await q.enqueue([np.array([1, 2, 3], np.int32), ["x"], np.ones((1, 2), np.float32), True])
    await q.enqueue([np.array([4], np.int32), ["y", "z"], np.ones((3, 2), np.float32), False])
    a, s, f, b = await q.dequeue_many(2)
    assert a.dtype == np.int32 and a.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert s.dtype == np.dtype("S1") and s.tolist() == [[b"x", b""], [b"y", b"z"]]
    assert f.dtype == np.float32 and f.shape == (2, 3, 2)
    assert f.tolist() == [[[1, 1], [0, 0], [0, 0]], [[1, 1]] * 3]
    assert b.dtype == np.bool_ and b.tolist() == [True, False]


async def test_string_padding_widths_and_single_dequeue(client):
    q = qps.PaddingFIFOQueue(10, "string", shapes=[[None, 2]], client=client)
    await q.enqueue([[["a", "bb"]]])  # one component: the list holds the values
    await q.enqueue(np.zeros((0, 2), "S7"))  # an empty element of a wider dtype
    await q.enqueue(np.array([["ccc", ""], ["d", "é"]]))  # unicode: UTF-8 bytes
    first = await q.dequeue()  # unpadded, as enqueued
    assert first.dtype == np.dtype("S2") and first.tolist() == [[b"a", b"bb"]]
    await q.enqueue([[[b"e", "f"]]])
    batch = await q.dequeue_many(3)
    assert batch.dtype == np.dtype("S7") and batch.shape == (3, 2, 2)  # widest element
    assert batch.tolist() == [
        [[b"", b""], [b"", b""]],
        [[b"ccc", b""], [b"d", "é".encode()]],
        [[b"e", b"f"], [b"", b""]],
    ]
    empty = await q.dequeue_many(0)
    assert empty.shape == (0, 0, 2) and empty.dtype.kind == "S"


async def test_41_fixed_dims_must_match(client):
    q = padq(client)
    with pytest.raises(InvalidArgumentError, match=r"Expected \[\?,2\], got \[1,3\]"):
        await q.enqueue([np.array([1], np.int32), np.ones((1, 3), np.float32), True])
    with pytest.raises(InvalidArgumentError, match="Shape mismatch in tuple component 0"):
        await q.enqueue([np.ones((1, 1), np.int32), np.ones((1, 2), np.float32), True])  # rank
    assert await q.size() == 0


def test_42_shapes_are_required():
    with pytest.raises(TypeError):
        qps.PaddingFIFOQueue(10, [np.int32])  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match="a list of shapes must be provided"):
        qps.PaddingFIFOQueue(10, [np.int32], shapes=None)
    with pytest.raises(InvalidArgumentError, match="a list of shapes must be provided"):
        qps.PaddingFIFOQueue(10, [np.int32, np.int32], shapes=[[None], None])


async def test_43_single_dequeue_is_unpadded(client):
    q = padq(client)
    await q.enqueue([np.zeros(0, np.int32), np.zeros((0, 2), np.float32), True])
    await q.enqueue([np.array([7, 8], np.int32), np.ones((1, 2), np.float32), False])
    a, b, c = await q.dequeue()
    assert a.shape == (0,) and b.shape == (0, 2) and bool(c) is True
    a, b, _ = await q.dequeue()
    assert a.tolist() == [7, 8] and b.shape == (1, 2)


async def test_enqueue_many_and_up_to_after_close(client):
    q = qps.PaddingFIFOQueue(10, np.int64, shapes=[[None]], client=client)
    await q.enqueue_many(np.array([[1, 2], [3, 4], [5, 6]], np.int64))  # each slice is [2]
    await q.enqueue(np.array([9], np.int64))
    await q.close()
    assert (await q.dequeue_up_to(10)).tolist() == [[1, 2], [3, 4], [5, 6], [9, 0]]
    with pytest.raises(OutOfRangeError):
        await q.dequeue_up_to(1)


async def test_empty_batch_shape(client):
    q = qps.PaddingFIFOQueue(10, np.float32, shapes=[[None, 3]], client=client)
    assert (await q.dequeue_many(0)).shape == (0, 0, 3)
