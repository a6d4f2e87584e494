"""Placement strategies, partitioners, partitioned variables and embedding_lookup, against
TF 1.x's documented arithmetic and the conformance cases 66-71 (docs/variables.md).

Pure functions are tested directly (with hypothesis); partitioned variables and lookups
from Redis run on both backends.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qps
from qps.errors import InvalidArgumentError
from qps.placement import (
    PartitionedVariable,
    embedding_lookup,
    fixed_size_partitioner,
    greedy_by_bytes,
    list_partitioned,
    lookup_plan,
    min_max_variable_partitioner,
    open_partitioned_variable,
    partition_offsets,
    partition_sizes,
    place,
    round_robin,
    tf_greedy_load_balancing,
    variable_axis_size_partitioner,
)
from qps.variables import Variable, list_variables

# -- placement ------------------------------------------------------------------------------------


def test_round_robin_is_tf_replica_device_setter() -> None:
    # case 66: v1, v2, v3, global_step on 2 PS -> tasks 0, 1, 0, 1
    assert round_robin(["v1", "v2", "v3", "global_step"], 2) == {
        "v1": 0,
        "v2": 1,
        "v3": 0,
        "global_step": 1,
    }
    # case 67: an explicitly placed variable keeps its task but consumes a slot
    assert round_robin(["a", "b", "c"], 3, pinned={"a": 1}) == {"a": 1, "b": 1, "c": 2}
    # resource variables: 0, 1, 2, 0
    assert list(round_robin(["a", "b", "c", "d"], 3).values()) == [0, 1, 2, 0]


def test_round_robin_places_partitions_like_variables() -> None:
    pv = PartitionedVariable("emb", (10, 4), partitioner=fixed_size_partitioner(3))
    # TF: part_0 -> 0, part_1 -> 1, part_2 -> 0 on 2 PS (the parts are separate variables)
    assert round_robin([pv, Variable("w", (3,))], 2) == {
        "emb/part_0": 0,
        "emb/part_1": 1,
        "emb/part_2": 0,
        "w": 1,
    }


def test_tf_greedy_depends_on_order() -> None:
    # case 68: TF's GreedyLoadBalancingStrategy, sizes in creation order
    assert tf_greedy_load_balancing([4000, 40, 40, 8000, 20], 2) == [0, 1, 1, 1, 0]
    assert tf_greedy_load_balancing([8000, 4000, 40, 40, 20], 2) == [0, 1, 1, 1, 1]


def test_greedy_by_bytes_example() -> None:
    sizes = {"a": 4000, "b": 40, "c": 40, "d": 8000, "e": 20}
    # largest first, ties by name, to the least-loaded shard (lowest index on ties)
    assert greedy_by_bytes(sizes, 2) == {"d": 0, "a": 1, "b": 1, "c": 1, "e": 1}
    assert greedy_by_bytes(list(sizes.items()), 3) == {"d": 0, "a": 1, "b": 2, "c": 2, "e": 2}
    assert place(sizes, 2, "greedy_by_bytes") == greedy_by_bytes(sizes, 2)
    assert place(list(sizes), 2) == round_robin(list(sizes), 2)
    vs = [Variable("x", (10,), np.float64), Variable("y", (30,), np.int8)]
    assert greedy_by_bytes(vs, 2) == {"x": 0, "y": 1}  # 80 B vs 30 B


names_and_sizes = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=4),
    st.integers(0, 10_000),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(sizes=names_and_sizes, shards=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_greedy_by_bytes_ignores_creation_order(
    sizes: dict[str, int], shards: int, seed: int
) -> None:
    items = list(sizes.items())
    expect = greedy_by_bytes(items, shards)
    random.Random(seed).shuffle(items)
    assert greedy_by_bytes(items, shards) == expect
    assert set(expect) == set(sizes) and all(0 <= s < shards for s in expect.values())
    # greedy (LPT) balance: the fullest shard exceeds the emptiest by at most one variable
    load = [sum(sizes[n] for n, s in expect.items() if s == k) for k in range(shards)]
    assert max(load) - min(load) <= max(sizes.values())


def test_placement_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        round_robin(["a"], 0)
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        round_robin(["a", "a"], 2)
    with pytest.raises(InvalidArgumentError, match="needs the size"):
        greedy_by_bytes(["a"], 2)
    with pytest.raises(InvalidArgumentError, match="pinned shard"):
        round_robin(["a"], 2, pinned={"a": 2})
    with pytest.raises(InvalidArgumentError, match="unknown placement"):
        place(["a"], 2, "random")
    with pytest.raises(InvalidArgumentError, match="cannot place"):
        round_robin([3], 2)


# -- partitioners -----------------------------------------------------------------------------------


def part_shapes(shape: list[int], partitions: list[int]) -> list[list[int]]:
    pv = PartitionedVariable("x", shape, np.float32, partitions)
    return [list(p.shape) for p in pv.parts]


def test_fixed_size_partitioner_cases() -> None:
    f3 = fixed_size_partitioner(3)
    assert f3([10, 4], np.float32) == [3, 1]
    assert part_shapes([10, 4], [3, 1]) == [[4, 4], [3, 4], [3, 4]]  # case 69
    assert f3([2, 4], np.float32) == [2, 1]  # k = min(3, 2)
    assert part_shapes([11], fixed_size_partitioner(4)([11], np.float32)) == [[3], [3], [3], [2]]
    p = fixed_size_partitioner(2, axis=1)([3, 5], np.float32)
    assert p == [1, 2] and part_shapes([3, 5], p) == [[3, 3], [3, 2]]


def test_min_max_variable_partitioner_cases() -> None:
    shape = [1000, 4]  # float32: 16000 bytes
    p8 = min_max_variable_partitioner(8, min_slice_size=1024)(shape, np.float32)
    assert p8 == [8, 1]  # min(8, ceil(16000 / 1024) = 16)
    assert {s[0] for s in part_shapes(shape, p8)} == {125}
    p3 = min_max_variable_partitioner(3, min_slice_size=1024)(shape, np.float32)
    assert [s[0] for s in part_shapes(shape, p3)] == [334, 333, 333]  # case 69
    assert min_max_variable_partitioner()(shape, np.float32) == [1, 1]  # default max 1
    assert min_max_variable_partitioner(100, min_slice_size=1024)(shape, np.float32) == [16, 1]
    assert min_max_variable_partitioner(100, min_slice_size=1024)([3, 4], np.float32) == [1, 1]
    assert min_max_variable_partitioner(100, min_slice_size=10)([3, 4], np.float32) == [3, 1]
    # strings count bytes_per_string_element bytes each, as in TF
    assert min_max_variable_partitioner(100, min_slice_size=16)([4], "S100") == [4]
    assert min_max_variable_partitioner(100, 0, 16, bytes_per_string_element=4)([4], "S1") == [1]


def test_variable_axis_size_partitioner_cases() -> None:
    shape = [1000, 4]
    assert variable_axis_size_partitioner(4000)(shape, np.float32) == [4, 1]  # 4 x 250
    assert variable_axis_size_partitioner(10)([5, 4], np.float32) == [5, 1]  # rows of 16 B
    assert variable_axis_size_partitioner(4000, max_shards=2)(shape, np.float32) == [2, 1]
    with pytest.raises(InvalidArgumentError):
        variable_axis_size_partitioner(0)
    with pytest.raises(InvalidArgumentError):
        variable_axis_size_partitioner(10, max_shards=0)


@settings(max_examples=200, deadline=None)
@given(
    dims=st.lists(st.integers(1, 3000), min_size=1, max_size=3),
    axis=st.integers(0, 2),
    max_parts=st.integers(1, 64),
    min_slice=st.integers(1, 1 << 20),
    dtype=st.sampled_from([np.int8, np.float32, np.float64]),
)
def test_min_max_follows_tf_formula(
    dims: list[int], axis: int, max_parts: int, min_slice: int, dtype: Any
) -> None:
    axis %= len(dims)
    got = min_max_variable_partitioner(max_parts, axis, min_slice)(dims, dtype)
    total = math.prod(dims) * np.dtype(dtype).itemsize
    k = max(1, min(dims[axis], max_parts, math.ceil(total / min_slice)))  # TF's text
    assert got == [k if d == axis else 1 for d in range(len(dims))]


@given(dim=st.integers(0, 10_000), k=st.integers(1, 50))
def test_partition_sizes_are_tf_uneven_split(dim: int, k: int) -> None:
    sizes = partition_sizes(dim, k)
    assert sum(sizes) == dim and len(sizes) == k
    q, r = divmod(dim, k)
    assert sizes == [q + 1] * r + [q] * (k - r)  # the first dim % k get one more
    assert partition_offsets(dim, k) == [sum(sizes[:i]) for i in range(k)]


def test_partitioned_variable_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="one axis"):
        PartitionedVariable("x", (4, 4), np.float32, [2, 2])
    with pytest.raises(InvalidArgumentError, match="rank"):
        PartitionedVariable("x", (4, 4), np.float32, [2])
    with pytest.raises(InvalidArgumentError, match="cannot make 5 partitions"):
        PartitionedVariable("x", (4, 4), np.float32, [5, 1])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        fixed_size_partitioner(2, axis=2)([4, 4], np.float32)


# -- partitioned variables in Redis -----------------------------------------------------------------


async def test_partitioned_variable_round_trip(client: qps.Client) -> None:
    full = np.arange(40, dtype=np.float32).reshape(10, 4)
    pv = PartitionedVariable(
        "emb", full.shape, np.float32, fixed_size_partitioner(3), initializer=full, client=client
    )
    assert [p.name for p in pv] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    # TF's save-slice info: "<full shape> <offset>,<length>:..."
    infos = [p.partition.save_slice_info(p.shape) for p in pv if p.partition is not None]
    assert infos == ["10 4 0,4:0,4", "10 4 4,3:0,4", "10 4 7,3:0,4"]
    value, versions = await pv.read()
    np.testing.assert_array_equal(value, full)
    assert versions == (0, 0, 0)
    rows, vers = await pv.read_rows([9, 0, 4, 4])
    np.testing.assert_array_equal(rows, full[[9, 0, 4, 4]])
    assert vers == (0, 0, 0)
    # the first creator's layout: another partitioning of the same name is refused
    with pytest.raises(InvalidArgumentError, match="partition 0 of 3 of 'emb'"):
        await PartitionedVariable("emb", (12, 4), np.float32, [3, 1], client=client).create()
    again = await open_partitioned_variable(client, "emb")
    assert (again.shape, again.partitions, len(again)) == ((10, 4), [3, 1], 3)
    np.testing.assert_array_equal((await again.read()).value, full)
    assert await list_partitioned(client) == ["emb"]
    tf_case = PartitionedVariable("t", (10, 1), np.float32, [3, 1])
    assert tf_case[1].partition is not None
    assert tf_case[1].partition.save_slice_info(tf_case[1].shape) == "10 1 4,3:0,1"


async def test_partitioned_on_axis_1_and_random_init(client: qps.Client) -> None:
    init = qps.initializers.glorot_uniform(seed=5)
    pv = PartitionedVariable("w", (6, 9), np.float32, [1, 2], initializer=init, client=client)
    value, _ = await pv.read()
    assert [p.shape for p in pv] == [(6, 5), (6, 4)] and value.shape == (6, 9)
    # the fans are the whole variable's
    assert np.abs(value).max() <= math.sqrt(6 / 15)
    with pytest.raises(InvalidArgumentError, match="axis 0"):
        await embedding_lookup(pv, [0])


# -- embedding_lookup ---------------------------------------------------------------------------------


def reference_lookup(shards: list[np.ndarray], ids: np.ndarray, strategy: str) -> np.ndarray:
    """TF's embedding_lookup, one id at a time, written from the formulas."""
    n_parts = len(shards)
    total = sum(len(s) for s in shards)
    out = []
    for i in ids.reshape(-1).tolist():
        if n_parts == 1:
            p, row = 0, i
        elif strategy == "mod":
            p, row = i % n_parts, i // n_parts
        else:
            q, r = divmod(total, n_parts)
            p = max(i // (q + 1), (i - r) // q)
            row = i % (q + 1) if p < r else (i - r) % q
        out.append(shards[p][row])
    return np.array(out).reshape(ids.shape + shards[0].shape[1:])


def test_lookup_plan_tf_cases() -> None:
    sizes = [4, 3, 3]  # rows 0..9 in 3 contiguous parts
    part, row = lookup_plan(np.arange(10), sizes, "div")
    offsets = np.array(partition_offsets(10, 3))
    assert (offsets[part] + row).tolist() == list(range(10))  # case 70: div is identity
    part, row = lookup_plan(np.arange(10), sizes, "mod")
    assert (offsets[part] + row).tolist() == [0, 4, 7, 1, 5, 8, 2, 6, 9, 3]  # case 70: mod
    with pytest.raises(InvalidArgumentError, match=r"partitions\[0\] = 3 is not in \[0, 3\)"):
        lookup_plan([10], sizes, "div")  # case 71
    with pytest.raises(InvalidArgumentError, match=r"indices\[3\] = 3 is not in \[0, 3\)"):
        lookup_plan(np.arange(10), [3, 3, 4], "div")  # issue #19265: uneven the other way
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] = 3 is not in \[0, 3\)"):
        lookup_plan([10], sizes, "mod")
    with pytest.raises(InvalidArgumentError, match=r"indices\[1\] = 5 is not in \[0, 5\)"):
        lookup_plan([1, 5], [5], "mod")
    with pytest.raises(InvalidArgumentError, match="Unrecognized partition strategy"):
        lookup_plan([1], sizes, "modulo")
    with pytest.raises(InvalidArgumentError, match="integers"):
        lookup_plan([1.5], sizes, "mod")
    part, row = lookup_plan([0, 1], [1, 1, 0], "div")  # fewer rows than partitions
    assert part.tolist() == [0, 1] and row.tolist() == [0, 0]


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 60),
    k=st.integers(1, 7),
    strategy=st.sampled_from(["mod", "div"]),
    data=st.data(),
)
def test_lookup_matches_reference(n: int, k: int, strategy: str, data: Any) -> None:
    k = min(k, n)
    table = np.arange(n * 2, dtype=np.int64).reshape(n, 2)
    shards = np.split(table, np.cumsum(partition_sizes(n, k))[:-1])
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=40)), np.int64)
    part, row = lookup_plan(ids, [len(s) for s in shards], strategy)
    got = np.array([shards[p][r] for p, r in zip(part, row)]).reshape((*ids.shape, 2))
    np.testing.assert_array_equal(got, reference_lookup(shards, ids, strategy))


@pytest.mark.parametrize("strategy", ["mod", "div"])
async def test_embedding_lookup_from_redis(client: qps.Client, strategy: str) -> None:
    rng = np.random.default_rng(7)
    full = rng.standard_normal((50, 3)).astype(np.float32)
    pv = PartitionedVariable("emb", (50, 3), np.float32, [4, 1], initializer=full, client=client)
    shards = [(await p.read()).value for p in pv]
    ids = np.array([[3, 49, 3], [0, 17, 17], [48, 2, 25]])  # repeats, 2-D
    want = reference_lookup(shards, ids, strategy)
    got = await embedding_lookup(pv, ids, strategy)
    assert got.shape == (3, 3, 3)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(await embedding_lookup(pv.parts, ids, strategy), want)
    np.testing.assert_array_equal(await embedding_lookup(shards, ids, strategy), want)
    if strategy == "div":
        np.testing.assert_array_equal(got, full[ids])
    single = Variable("one", initializer=full, client=client)
    np.testing.assert_array_equal(await embedding_lookup(single, ids, strategy), full[ids])
    with pytest.raises(InvalidArgumentError, match="is not in"):
        await embedding_lookup(pv, [50], strategy)
    with pytest.raises(InvalidArgumentError, match="partitions differ"):
        await embedding_lookup([full, full[:, :2]], [0], strategy)


@pytest.mark.parametrize("first", ["lookup", "read_rows"])
async def test_a_lookup_of_a_few_ids_creates_every_part(client: qps.Client, first: str) -> None:
    """docs/variables.md: ids 0, 1 and 99,999 touch parts 0 and 3 of 4; parts 1 and 2
    used to stay uncreated, and `qps var stat emb` then failed on 'emb/part_1'."""
    pv = PartitionedVariable("few", (100, 2), np.float32, [4, 1], client=client)
    ids = np.array([0, 1, 99])
    if first == "lookup":
        await embedding_lookup(pv, ids, "div")
    else:
        await pv.read_rows(ids)
    assert sorted(await list_variables(client)) == [f"few/part_{i}" for i in range(4)]
    opened = await open_partitioned_variable(client, "few")
    assert opened.shape == (100, 2)


async def test_tf_case_70_from_redis(client: qps.Client) -> None:
    rows = np.arange(10, dtype=np.int32).reshape(10, 1)
    pv = PartitionedVariable("ids", (10, 1), np.int32, [3, 1], initializer=rows, client=client)
    ids = np.arange(10)
    assert (await embedding_lookup(pv, ids, "div")).ravel().tolist() == list(range(10))
    assert (await embedding_lookup(pv, ids)).ravel().tolist() == [0, 4, 7, 1, 5, 8, 2, 6, 9, 3]
    with pytest.raises(InvalidArgumentError, match=r"partitions\[0\] = 3 is not in \[0, 3\)"):
        await embedding_lookup(pv, [10], "div")
