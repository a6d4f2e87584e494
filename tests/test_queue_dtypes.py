"""How enqueued values become a component's dtype (docs/queues.md, "Dtypes").

An empty Python list is an empty array of the component's dtype, whatever that dtype,
as in TF (``tf.convert_to_tensor([], tf.int32)``): it holds no value that could be of the
wrong type. A NumPy value must still have the component's dtype exactly, where TF would
cast it silently (a deliberate difference).
"""

from __future__ import annotations

import numpy as np
import pytest

import qps
from qps.errors import InvalidArgumentError

DTYPES = [
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.bool_, np.float16, np.float32, np.float64, qps.string,
]  # fmt: skip


def _is_empty_of(arr: np.ndarray, dtype: object, shape: tuple[int, ...]) -> bool:
    want = np.dtype(dtype)
    same = arr.dtype.kind == "S" if want.kind == "S" else arr.dtype == want
    return same and arr.shape == shape


async def test_issue_case_padding_queue_with_an_empty_list(client):
    """The report: an empty list for the int32 component was refused as float64."""
    q = qps.PaddingFIFOQueue(5, [np.int32, np.int64, np.int64], [[None], [2], []], client=client)
    await q.enqueue([[], np.int64([10, 11]), np.int64(10)])
    await q.enqueue([[7, 8], np.int64([12, 13]), np.int64(11)])
    a, b, c = await q.dequeue_many(2)
    assert a.dtype == np.int32 and a.tolist() == [[0, 0], [7, 8]]  # padded
    assert b.tolist() == [[10, 11], [12, 13]] and c.tolist() == [10, 11]
    await q.enqueue([[], np.int64([1, 2]), np.int64(3)])
    got = await q.dequeue()
    assert _is_empty_of(got[0], np.int32, (0,))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_empty_list_for_every_dtype_and_queue(client, dtype):
    fifo = qps.FIFOQueue(5, [dtype], client=client)  # no shapes
    await fifo.enqueue(([],))
    await fifo.enqueue(([[]],))  # nested: shape [1, 0]
    assert _is_empty_of(await fifo.dequeue(), dtype, (0,))
    assert _is_empty_of(await fifo.dequeue(), dtype, (1, 0))

    shaped = qps.FIFOQueue(5, [dtype], shapes=[[2, 0]], client=client)
    await shaped.enqueue(([[], ()],))  # tuples are lists too
    assert _is_empty_of(await shaped.dequeue(), dtype, (2, 0))
    await shaped.enqueue_many(([[[], []], [[], []], [[], []]],))  # a batch of 3
    assert _is_empty_of(await shaped.dequeue_many(3), dtype, (3, 2, 0))

    padding = qps.PaddingFIFOQueue(5, [dtype, np.int64], [[None], []], client=client)
    await padding.enqueue([[], 1])
    await padding.enqueue_many([[[], []], [2, 3]])  # two empty elements
    one, tag = await padding.dequeue()
    assert _is_empty_of(one, dtype, (0,)) and tag == 1
    batch, tags = await padding.dequeue_many(2)
    assert _is_empty_of(batch, dtype, (2, 0)) and tags.tolist() == [2, 3]

    shuffle = qps.RandomShuffleQueue(5, 0, [dtype], shapes=[[0]], client=client)
    await shuffle.enqueue(([],))
    assert _is_empty_of(await shuffle.dequeue(), dtype, (0,))

    prio = qps.PriorityQueue(5, [dtype], shapes=[[0]], client=client)
    await prio.enqueue([np.int64(2), []])
    await prio.enqueue_many([[1], [[]]])
    first, second = await prio.dequeue(), await prio.dequeue()
    assert first[0] == 1 and second[0] == 2
    assert _is_empty_of(first[1], dtype, (0,)) and _is_empty_of(second[1], dtype, (0,))

    scalars = qps.FIFOQueue(5, [dtype], shapes=[[]], client=client)
    await scalars.enqueue_many(([],))  # an empty batch, as a Python list
    assert await scalars.size() == 0


@pytest.mark.parametrize(
    ("dtype", "value", "got"),
    [
        (np.int64, np.float32(1.0), "float32"),  # TF casts it to 1
        (np.int64, np.array([1.0, 2.0], np.float32), "float32"),
        (np.int32, np.int64(1), "int64"),
        (np.float32, np.float64(0.5), "float64"),
        (np.int32, np.zeros(0, np.float64), "float64"),  # an empty NumPy array too
        (np.bool_, np.array([1], np.int8), "int8"),
    ],
)
async def test_numpy_values_must_have_the_exact_dtype(client, dtype, value, got):
    q = qps.FIFOQueue(5, [np.int64, dtype], client=client)
    want = np.dtype(dtype).name
    with pytest.raises(InvalidArgumentError) as info:
        await q.enqueue([np.int64(0), value])
    assert str(info.value) == f"Type mismatch in tuple component 1: expected {want}, got {got}"
    assert await q.size() == 0


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.int32, [1.5]),
        (np.int32, [[], [1.5]]),  # ragged: not an empty list
        (np.int32, [np.zeros(0, np.float32)]),  # holds a NumPy value of another dtype
        (np.bool_, [1]),
        (np.int64, ["a"]),
        (qps.string, [1]),
    ],
    ids=repr,
)
async def test_lists_that_are_not_empty_keep_the_rules(client, dtype, value):
    q = qps.FIFOQueue(5, [dtype], client=client)
    with pytest.raises(InvalidArgumentError, match="component 0"):
        await q.enqueue((value,))
    assert await q.size() == 0
