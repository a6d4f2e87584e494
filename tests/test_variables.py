"""Variables: storage, versions, fencing, consistent reads, rows, initializers, reset and
``qps var``.

The library tests run on both backends (``client``/``make_client``); the CLI tests run
through click's CliRunner against the real server (``redis_url``), each in a container
of its own, as tests/test_cli.py does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
from qps import initializers, varread, varspec
from qps import variables as V
from qps.cli.main import cli
from qps.containers import container_stats, reset
from qps.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.variables import (
    StaleTokenError,
    Variable,
    delete_variable,
    list_variables,
    open_variable,
    variable_stats,
)
from tests.corruption import dump_all, of_container

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    ml_dtypes = None


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny segments and chunks, so that small variables take the multi-segment,
    multi-chunk paths (the layout is fixed at creation and stored)."""
    monkeypatch.setattr(varspec, "SEGMENT_BYTES", 200)
    monkeypatch.setattr(varspec, "CHUNK_BYTES", 64)


async def state(client: qps.Client) -> dict[bytes, Any]:
    """Every key with its value, and whether it has a TTL (not how long: it runs)."""
    return {k: (t, v, ttl > 0) for k, (t, v, ttl) in (await dump_all(client)).items()}


async def var_keys(client: qps.Client, container: str) -> list[bytes]:
    return sorted(
        [k async for k in client.commands.scan_iter(match=f"qps:{{{container}/v/*", count=1000)]
    )


# -- dtypes and round trips -------------------------------------------------------------------

DTYPES: list[Any] = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    "S5",
]
if ml_dtypes is not None:
    DTYPES.append(ml_dtypes.bfloat16)


def sample(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "S":
        return np.array(
            [secrets.token_hex(3)[: 1 + i % 5].encode() for i in range(int(np.prod(shape)))],
            dt,
        ).reshape(shape)
    return (rng.standard_normal(shape) * 100).astype(dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_round_trip_every_dtype(client: qps.Client, dtype: Any) -> None:
    first, second = sample(dtype, (7, 3), 1), sample(dtype, (7, 3), 2)
    v = Variable("w", dtype=dtype, initializer=first, client=client, container="rt")
    got, version = await v.read()
    assert version == 0 and got.dtype == np.dtype(dtype) and got.shape == (7, 3)
    np.testing.assert_array_equal(got, first)
    await v.publish(second, 1, 0)
    got, version = await v.read()
    assert version == 1
    np.testing.assert_array_equal(got, second)
    rows, version = await v.read_rows([6, 0, 6])
    np.testing.assert_array_equal(rows, second[[6, 0, 6]])
    await v.publish_rows([3], first[[3]], 2, 0)
    expect = second.copy()
    expect[3] = first[3]
    np.testing.assert_array_equal((await v.read()).value, expect)


async def test_big_endian_and_scalar_and_empty(client: qps.Client) -> None:
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    v = Variable("be", initializer=be, dtype=">i4", client=client)
    got = (await v.read()).value
    assert got.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(got, be)
    s = Variable("scalar", (), np.float64, initializer=initializers.constant(2.5), client=client)
    value, version = await s.read()
    assert value.shape == () and float(value) == 2.5 and version == 0
    await s.publish(np.float64(-1), 1, 0)
    assert float((await s.read()).value) == -1.0
    with pytest.raises(InvalidArgumentError, match="scalar"):
        await s.read_rows([0])
    e = Variable("empty", (0, 4), np.float32, client=client)
    value, version = await e.read()
    assert value.shape == (0, 4) and version == 0
    await e.publish(np.zeros((0, 4), np.float32), 1, 0)
    assert (await e.read()).version == 1
    assert (await e.read_rows(np.zeros(0, np.int64))).value.shape == (0, 4)


async def test_values_are_writable_copies(client: qps.Client) -> None:
    v = Variable("w", (3,), np.float32, initializer="ones", client=client)
    value, _ = await v.read()
    value[0] = 7  # the caller owns it
    assert (await v.read()).value[0] == 1


# -- creation -----------------------------------------------------------------------------------


async def test_first_creator_wins_and_mismatch_is_refused(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    a = Variable("w", (4, 2), np.float32, initializer=initializers.constant(3), client=c1)
    await a.create()
    b = Variable("w", (4, 2), np.float32, initializer="ones", trainable=False, client=c2)
    value, version = await b.read()
    np.testing.assert_array_equal(value, np.full((4, 2), 3, np.float32))
    assert version == 0
    assert b.trainable is True  # the stored spec is the creator's
    assert b.spec.initializer == {"kind": "constant", "value": 3}
    with pytest.raises(
        InvalidArgumentError,
        match=r"Shared variable 'w' has shape \[4,2\] but requested shape was \[4,3\]",
    ):
        await Variable("w", (4, 3), np.float32, client=c2).create()
    with pytest.raises(
        InvalidArgumentError,
        match="Shared variable 'w' has dtype float32 but requested dtype was int32",
    ):
        await Variable("w", (4, 2), np.int32, client=c2).create()
    assert await list_variables(c1) == ["w"]


async def test_concurrent_creators_agree(make_client: Any) -> None:
    clients = [await make_client() for _ in range(4)]
    vs = [
        Variable("w", (50, 8), np.float32, initializer=initializers.random_normal(), client=c)
        for c in clients
    ]
    reads = await asyncio.gather(*(v.read() for v in vs))
    for r in reads[1:]:
        np.testing.assert_array_equal(r.value, reads[0].value)
    # the losers' initial values were removed: one generation of one segment (and the
    # copy of the current value a small variable keeps for plain reads)
    found = sorted(k.rsplit(b"}:", 1)[1] for k in await var_keys(clients[0], "default"))
    assert len(found) == 3 and found[0] == b"cur" and found[1].startswith(b"d:")
    assert found[2] == b"meta"


async def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="give a shape"):
        Variable("w")
    with pytest.raises(InvalidArgumentError, match="every dimension"):
        Variable("w", (3, -1))
    with pytest.raises(InvalidArgumentError, match="fixed width"):
        Variable("w", (3,), "S")
    with pytest.raises(InvalidArgumentError, match="cannot be sent"):
        Variable("w", (3,), np.complex64)
    with pytest.raises(InvalidArgumentError, match="initial value has shape"):
        Variable("w", (3,), initializer=np.zeros(4))
    with pytest.raises(InvalidArgumentError, match="cannot become int32"):
        Variable("w", (3,), np.int32, initializer=np.zeros(3))
    with pytest.raises(InvalidArgumentError, match="over the"):
        Variable("w", (1 << 32, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match="unknown initializer"):
        Variable("w", (3,), initializer="gaussian")
    with pytest.raises(InvalidArgumentError, match="invalid resource name"):
        Variable("bad name", (3,))


# -- initializers ----------------------------------------------------------------------------------


async def test_initializers_are_deterministic_with_a_seed(client: qps.Client) -> None:
    shape = (40, 30)
    inits = {
        "zeros": initializers.zeros(),
        "ones": initializers.ones(),
        "constant": initializers.constant(-2),
        "random_normal": initializers.random_normal(1.0, 0.5, seed=3),
        "truncated_normal": initializers.truncated_normal(0.0, 2.0, seed=3),
        "random_uniform": initializers.random_uniform(-1, 3, seed=3),
        "glorot_uniform": initializers.glorot_uniform(seed=3),
    }
    for name, init in inits.items():
        a = (await Variable(name, shape, initializer=init, client=client, container="c1").read())[0]
        b = (await Variable(name, shape, initializer=init, client=client, container="c2").read())[0]
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, init(shape, np.float32))
    limit = np.sqrt(6 / (40 + 30))
    g = inits["glorot_uniform"](shape, np.float32)
    assert np.abs(g).max() <= limit and np.abs(g).max() > 0.9 * limit
    t = inits["truncated_normal"]((100_000,), np.float64)
    assert np.abs(t).max() <= 4.0 and abs(t.std() - 2 * 0.8796) < 0.05
    u = initializers.random_uniform(0, 10, seed=1)((1000,), np.int32)
    assert u.dtype == np.int32 and u.min() >= 0 and u.max() <= 9
    assert initializers.glorot_limit([3, 3, 4, 8]) == pytest.approx(np.sqrt(6 / (36 + 72)))
    unseeded = initializers.random_normal()
    assert not np.array_equal(unseeded((10,), np.float32), unseeded((10,), np.float32))


async def test_default_initializer_is_glorot_for_floats(client: qps.Client) -> None:
    f = Variable("f", (10, 10), client=client)
    assert f.spec.initializer == {"kind": "glorot_uniform", "seed": None}
    assert np.abs((await f.read()).value).max() <= np.sqrt(6 / 20)
    i = Variable("i", (3,), np.int64, client=client)
    assert i.spec.initializer == {"kind": "zeros"}
    with pytest.raises(InvalidArgumentError, match="float dtype"):
        await Variable("n", (3,), np.int32, initializer="random_normal", client=client).create()
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        initializers.constant(300)((2,), np.int8)


# -- versions and fencing ---------------------------------------------------------------------


async def test_versions_must_increase(client: qps.Client) -> None:
    v = Variable("w", (5,), np.float32, initializer="zeros", client=client)
    assert await v.version() == 0
    await v.publish(np.ones(5), 3, 0)
    assert await v.version() == 3
    before = await state(client)
    for bad in (3, 2):
        with pytest.raises(FailedPreconditionError, match="versions must increase"):
            await v.publish(np.full(5, 9), bad, 0)
        with pytest.raises(FailedPreconditionError, match="versions must increase"):
            await v.publish_rows([1], [9], bad, 0)
    assert await state(client) == before
    await v.publish_rows([1], [7], 4, 0)
    value, version = await v.read()
    assert value.tolist() == [1, 7, 1, 1, 1] and version == 4
    with pytest.raises(InvalidArgumentError, match=r"not in \[0, 2\*\*53\)"):
        await v.publish(np.ones(5), -1, 0)
    with pytest.raises(InvalidArgumentError, match="must be an int"):
        await v.publish(np.ones(5), 5, True)


async def test_stale_token_is_refused_and_nothing_changes(make_client: Any) -> None:
    old_c, new_c = await make_client(), await make_client()
    old = Variable("w", (600, 8), np.float32, initializer="ones", client=old_c, container="f")
    new = Variable("w", (600, 8), np.float32, client=new_c, container="f")
    await old.publish(np.full((600, 8), 2, np.float32), 1, 5)  # the first owner, token 5
    assert await new.fence(6) == 1  # a new owner takes over
    before = await state(new_c)
    with pytest.raises(StaleTokenError, match=r"fencing token 5 refused.*accepted token 6"):
        await old.publish(np.full((600, 8), 3, np.float32), 2, 5)
    with pytest.raises(StaleTokenError):
        await old.publish_rows([0, 1], np.zeros((2, 8)), 2, 5)
    with pytest.raises(StaleTokenError):
        await old.fence(5)
    assert await state(new_c) == before  # no data, no staged rows, no meta change
    assert (await old.read()).version == 1
    await new.publish(np.full((600, 8), 4, np.float32), 2, 6)
    await new.publish_rows([599], np.zeros((1, 8)), 3, 7)  # a higher token is accepted
    s = await variable_stats(new_c, "w", "f")
    assert (s.version, s.token, s.publishes, s.row_publishes) == (3, 7, 2, 1)
    with pytest.raises(StaleTokenError):
        await new.publish(np.ones((600, 8)), 4, 6)


async def test_publish_checks_the_value(client: qps.Client) -> None:
    v = Variable("w", (4, 2), np.int32, initializer="zeros", client=client)
    with pytest.raises(InvalidArgumentError, match=r"shape \[4,2\], the value \[2,4\]"):
        await v.publish(np.zeros((2, 4), np.int32), 1, 0)
    with pytest.raises(InvalidArgumentError, match="cannot become int32"):
        await v.publish(np.zeros((4, 2), np.float32), 1, 0)
    with pytest.raises(InvalidArgumentError, match="repeat row 1"):
        await v.publish_rows([1, 2, 1], np.zeros((3, 2), np.int32), 1, 0)
    with pytest.raises(InvalidArgumentError, match=r"indices\[1\] = 4 is not in \[0, 4\)"):
        await v.publish_rows([0, 4], np.zeros((2, 2), np.int32), 1, 0)
    with pytest.raises(InvalidArgumentError, match="expected"):
        await v.publish_rows([0], np.zeros((1, 3), np.int32), 1, 0)
    with pytest.raises(InvalidArgumentError, match="1-D"):
        await v.publish_rows([[0]], np.zeros((1, 1, 2), np.int32), 1, 0)
    assert await v.version() == 0


# -- consistency ----------------------------------------------------------------------------------

N4 = (4 << 20) // 8  # a 4 MiB int64 variable: 2 segments, 5 chunks


def at(version: int) -> np.ndarray:
    """The value published as ``version``: each element tells its version and place."""
    return np.arange(N4, dtype=np.int64) + (version << 32)


def check(value: np.ndarray, version: int) -> None:
    assert np.array_equal(value, at(version)), f"not exactly version {version}"


async def test_consistent_reads_while_publishing(make_client: Any) -> None:
    wc, rc = await make_client(), await make_client()
    writer = Variable("big", (N4,), np.int64, initializer=at(0), client=wc)
    reader = Variable("big", (N4,), np.int64, client=rc)
    await writer.create()
    done = asyncio.Event()
    published = []

    async def publish() -> None:
        version = 0
        while not done.is_set() or version < 12:
            version += 1
            await writer.publish(at(version), version, 0)
            published.append(version)

    task = asyncio.create_task(publish())
    seen = []
    try:
        while len(seen) < 12 or len(published) < 12:
            value, version = await reader.read()
            check(value, version)
            seen.append(version)
            rows, rversion = await reader.read_rows([N4 - 1, 0, 5])
            assert rows.tolist() == [x + (rversion << 32) for x in (N4 - 1, 0, 5)]
        done.set()
        await task
    finally:
        task.cancel()
    assert seen == sorted(seen)  # versions never go back
    assert len(set(seen)) > 1  # the reads really overlapped the publishes


async def test_read_survives_exactly_one_flip(client: qps.Client) -> None:
    """The lock-free read step by step: a generation retired by one flip is still read
    whole at its version; two flips, or rows written into it, make the attempt fail."""
    v = await Variable("big", (N4,), np.int64, initializer=at(0), client=client).create()

    async def attempt(pointer: tuple[Any, Any]) -> qps.VariableValue | None:
        done, got = await varread.read_lean(v, client, *pointer)
        if not done:
            pytest.skip("no lean connections (fakeredis): large reads are atomic there")
        return got

    pointer = await varread.pointer(v, client)
    await v.publish(at(1), 1, 0)
    got = await attempt(pointer)
    assert got is not None and got.version == 0
    check(got.value, 0)
    await v.publish(at(2), 2, 0)  # the generation of version 0 is gone now
    assert await attempt(pointer) is None
    pointer = await varread.pointer(v, client)
    await v.publish_rows([7], [at(3)[7]], 3, 0)  # written in place after we looked
    assert await attempt(pointer) is None
    value, version = await v.read()
    expect = at(2)
    expect[7] = at(3)[7]
    assert version == 3 and np.array_equal(value, expect)


async def test_atomic_fallback(client: qps.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varread, "READ_ATTEMPTS", 0)
    v = Variable("big", (N4,), np.int64, initializer=at(0), client=client)
    await v.publish(at(1), 1, 0)
    value, version = await v.read()
    check(value, 1)
    assert version == 1


async def test_previous_generation_expires(client: qps.Client, backend: str) -> None:
    v = Variable("big", (N4,), np.int64, initializer=at(0), client=client)
    await v.publish(at(1), 1, 0)
    s = await v.stats()
    assert s.previous and s.previous_version == 0 and s.segments == 2
    prev = f"qps:{{default/v/big}}:d:{s.previous}:0"
    assert 0 < await client.commands.pttl(prev) <= V.PREV_TTL_MS
    await v.publish(at(2), 2, 0)
    assert not await client.commands.exists(prev)
    assert len(await var_keys(client, "default")) == 1 + 2 * 2  # meta, 2 generations
    if backend == "redis":  # segments just under 4 MiB: no allocator rounding waste
        assert s.memory_bytes is not None and s.memory_bytes < 2 * (4 << 20) * 1.01


# -- rows ----------------------------------------------------------------------------------------


async def test_read_rows_matches_numpy(
    client: qps.Client, small_segments: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(varread, "ROWS_BATCH_BYTES", 300)  # several scripts per call
    table = np.random.default_rng(0).standard_normal((103, 3, 2)).astype(np.float32)
    v = Variable("emb", initializer=table, client=client)
    assert v._layout.nseg == 13  # 8 rows of 24 bytes per 200-byte segment
    rng = np.random.default_rng(1)
    cases = [
        np.array([5]),
        np.array([102, 0, 102, 7, 7, 8, 9, 10, 50, 3]),  # repeats, unsorted, runs, gaps
        np.arange(103)[::-1],
        rng.integers(0, 103, (4, 25)),  # 2-D ids
        np.array([], np.int64),
        np.array([7, 8], np.uint8),
    ]
    for ids in cases:
        rows, version = await v.read_rows(ids)
        assert version == 0 and rows.shape == (*ids.shape, 3, 2)
        np.testing.assert_array_equal(rows, table[ids])
    with pytest.raises(InvalidArgumentError, match=r"indices\[2\] = 103 is not in \[0, 103\)"):
        await v.read_rows([1, 2, 103])
    with pytest.raises(InvalidArgumentError, match=r"indices\[0\] = -1"):
        await v.read_rows([-1])
    with pytest.raises(InvalidArgumentError, match="must be integers"):
        await v.read_rows([1.0])


async def test_read_rows_in_one_transaction(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last attempt of a multi-script read runs them inside MULTI/EXEC."""
    monkeypatch.setattr(varread, "READ_ATTEMPTS", 0)
    monkeypatch.setattr(varread, "ROWS_BATCH_BYTES", 64)
    table = np.arange(200, dtype=np.int64).reshape(50, 4)
    v = Variable("t", initializer=table, client=client)
    ids = np.array([49, 3, 3, 20, 0, 31])
    rows, version = await v.read_rows(ids)
    np.testing.assert_array_equal(rows, table[ids])
    assert version == 0


async def test_publish_rows_matches_numpy(client: qps.Client, small_segments: None) -> None:
    table = np.zeros((103, 5), np.float64)  # 40-byte rows, 5 per segment
    v = Variable("emb", (103, 5), np.float64, initializer="zeros", client=client)
    rng = np.random.default_rng(2)
    for version in range(1, 6):
        ids = rng.choice(103, size=30, replace=False)
        rows = rng.standard_normal((30, 5))
        table[ids] = rows
        await v.publish_rows(ids, rows, version, 0)
        value, got = await v.read()
        assert got == version
        np.testing.assert_array_equal(value, table)
    await v.publish_rows(np.arange(103), -table, 6, 0)  # every segment, one call
    np.testing.assert_array_equal((await v.read()).value, -table)
    assert not [k for k in await var_keys(client, "default") if b":s:" in k]  # stages gone


async def test_multi_segment_publish_and_read(client: qps.Client, small_segments: None) -> None:
    value = np.arange(1000, dtype=np.int32).reshape(250, 4)  # 16-byte rows, 12 per segment
    v = Variable("w", value.shape, np.int32, initializer="zeros", client=client)
    np.testing.assert_array_equal((await v.read()).value, np.zeros_like(value))
    await v.publish(value, 1, 0)
    got, version = await v.read()
    np.testing.assert_array_equal(got, value)
    assert version == 1 and (await v.stats()).segments == 21


async def test_sparse_pull_of_a_big_table(client: qps.Client) -> None:
    """4,096 random rows of a 64k x 64 float32 table (16 MiB: 4 segments)."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((65536, 64)).astype(np.float32)
    v = Variable("emb", initializer=table, client=client)
    ids = rng.integers(0, 65536, 4096)
    rows, _ = await v.read_rows(ids)
    np.testing.assert_array_equal(rows, table[ids])


# -- inspection, deletion, reset -------------------------------------------------------------------


async def test_open_stats_list_delete(client: qps.Client) -> None:
    v = Variable("a/b", (3, 2), np.int16, initializer=[[1, 2], [3, 4], [5, 6]], client=client)
    await v.publish(np.ones((3, 2), np.int16), 1, 0)
    w = await open_variable(client, "a/b")
    assert (w.shape, w.dtype, w.spec.initializer) == ((3, 2), np.dtype(np.int16), {"kind": "array"})
    assert (await w.read()).version == 1
    s = (await variable_stats(client, "a/b")).as_dict()
    assert s["dtype"] == "int16" and s["shape"] == [3, 2] and s["version"] == 1
    assert s["created_ms"] <= s["updated_ms"] and s["segments"] == 1
    assert await list_variables(client) == ["a/b"]
    with pytest.raises(NotFoundError, match="no variable 'x'"):
        await open_variable(client, "x")
    with pytest.raises(NotFoundError):
        await variable_stats(client, "x")
    assert await delete_variable(client, "a/b") >= 2
    assert await list_variables(client) == [] and not await var_keys(client, "default")
    with pytest.raises(NotFoundError, match="was it reset"):
        await w.read()


async def test_session_variable_and_container_stats(client: qps.Client) -> None:
    async with qps.Session(container="job", client=client) as s:
        v = s.variable("w", (2, 2), np.float32, initializer="ones")
        await v.create()
        await s.partitioned_variable("emb", (10, 4), partitioner=[2, 1]).create()
        assert await s.list_variables() == ["emb/part_0", "emb/part_1", "w"]
        stats = await container_stats(client, "job", memory=False)
    assert stats.resources["variables"] == ["emb/part_0", "emb/part_1", "w"]
    assert stats.keys_by_kind["variables"] == 9  # 3 x (meta + one segment + its copy, cur)


async def test_reset_removes_every_variable_key(client: qps.Client, small_segments: None) -> None:
    keep = Variable("w", (40, 3), np.float32, initializer="ones", client=client, container="b")
    await keep.create()
    before = of_container(await dump_all(client), "b")
    v = Variable("w", (40, 3), np.float32, initializer="ones", client=client, container="a")
    await v.publish(np.zeros((40, 3)), 1, 0)  # a kept previous generation too
    await v.publish_rows([1], np.ones((1, 3)), 2, 0)
    await client.commands.set("qps:{a/v/w}:s:orphan", b"x", px=60_000)  # a stage left over
    assert len(await var_keys(client, "a")) == 1 + 2 * 3 + 1  # meta, 2 generations, stage
    (result,) = await reset(client, ["a"])
    assert result.resources["variables"] == ["w"]
    assert not await var_keys(client, "a")
    assert not of_container(await dump_all(client), "a")
    assert of_container(await dump_all(client), "b") == before
    with pytest.raises(NotFoundError, match="was it reset"):
        await v.read()
    with pytest.raises(NotFoundError):
        await v.publish(np.zeros((40, 3)), 3, 0)
    assert not await var_keys(client, "a")  # the refused publish left nothing behind
    fresh = Variable("w", (40, 3), np.float32, initializer="zeros", client=client, container="a")
    assert (await fresh.read()).version == 0  # created afresh


async def test_writer_of_a_recreated_variable_is_refused(make_client: Any) -> None:
    c1, c2 = await make_client(), await make_client()
    old = await Variable("w", (4,), np.float32, initializer="ones", client=c1).create()
    await delete_variable(c2, "w")
    await Variable("w", (5,), np.float32, initializer="zeros", client=c2).create()
    with pytest.raises(FailedPreconditionError, match="created again with another shape"):
        await old.publish(np.zeros(4), 1, 0)
    with pytest.raises(FailedPreconditionError, match="created again"):
        await old.publish_rows([0], [1], 1, 0)
    assert len(await var_keys(c2, "default")) == 3  # meta, d:<gen>:0, cur: nothing more


async def test_corrupt_meta_is_reported(client: qps.Client) -> None:
    await client.commands.hset("qps:{default/v/bad}:meta", "spec", "{nope")
    with pytest.raises(DataLossError, match="bad variable spec"):
        await open_variable(client, "bad")


# -- CLI -------------------------------------------------------------------------------------------


@pytest.fixture
def cname() -> str:
    return f"vartest-{secrets.token_hex(4)}"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def setup_vars(url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(url) as c:
            v = Variable(
                "w",
                initializer=np.arange(12, dtype=np.float32).reshape(4, 3),
                client=c,
                container=container,
            )
            await v.publish(np.arange(12, dtype=np.float32).reshape(4, 3) * 2, 5, 1)
            await qps.PartitionedVariable(
                "emb",
                (5, 2),
                np.int64,
                [2, 1],
                initializer=np.arange(10).reshape(5, 2),
                client=c,
                container=container,
            ).create()

    asyncio.run(go())


def test_cli_var(redis_url: str, cname: str) -> None:
    opts = ["--url", redis_url, "--container", cname]
    r = invoke("var", "ls", *opts)
    assert r.exit_code == 0 and f"no variables in container '{cname}'" in r.output
    setup_vars(redis_url, cname)
    r = invoke("var", "ls", *opts)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == [
        "NAME",
        "DTYPE",
        "SHAPE",
        "BYTES",
        "VERSION",
        "TOKEN",
        "TRAINABLE",
        "PART",
    ]
    assert lines[3].split() == ["w", "float32", "[4,3]", "48", "5", "1", "yes", "-"]
    assert lines[1].split()[-3:] == ["0/2", "of", "emb"]
    listed = json.loads(invoke("var", "ls", *opts, "--json").output)
    assert [d["name"] for d in listed] == ["emb/part_0", "emb/part_1", "w"]

    r = invoke("var", "stat", "w", *opts)
    assert r.exit_code == 0
    assert "version        5" in r.output and "fencing token  1" in r.output
    assert "array()" in r.output
    d = json.loads(invoke("var", "stat", "emb/part_1", *opts, "--json").output)
    assert d["save_slice_info"] == "5 2 3,2:0,2" and d["partition"]["index"] == 1
    parts = json.loads(invoke("var", "stat", "emb", *opts, "--json").output)
    assert [p["name"] for p in parts] == ["emb/part_0", "emb/part_1"]

    r = invoke("var", "get", "w", *opts)
    assert r.exit_code == 0
    assert r.output.startswith(f"{cname}/w: float32 [4,3], version 5\n")
    d = json.loads(invoke("var", "get", "w", "--rows", "3,0:2", *opts, "--json").output)
    assert d["rows"] == [3, 0, 1] and d["value_shape"] == [3, 3] and d["version"] == 5
    assert d["values"] == [18, 20, 22, 0, 2, 4, 6, 8, 10] and not d["truncated"]
    d = json.loads(invoke("var", "get", "w", "--limit", "2", *opts, "--json").output)
    assert d["values"] == [0, 2] and d["truncated"]
    d = json.loads(invoke("var", "get", "emb", "--rows", "4,1", *opts, "--json").output)
    assert d["values"] == [8, 9, 2, 3] and d["versions"] == [0, 0] and d["parts"] == 2

    r = CliRunner().invoke(cli, ["var", "get", "w", "--rows", "4", *opts])
    assert r.exit_code == 2 and "row not in [0, 4)" in r.output
    r = CliRunner().invoke(cli, ["var", "get", "w", "--rows", "x:", *opts])
    assert r.exit_code == 2 and "expected row numbers" in r.output
    for cmd in ("get", "stat"):
        r = CliRunner().invoke(cli, ["var", cmd, "nope", *opts])
        assert r.exit_code == 3 and f"no variable 'nope' in container '{cname}'" in r.output
    r = CliRunner().invoke(cli, ["var", "--help"])
    assert r.exit_code == 0 and "ls" in r.output and "get" in r.output

    stat = json.loads(invoke("container", "stat", cname, "--url", redis_url, "--json").output)
    assert stat["resource_counts"]["variables"] == 3


async def test_read_many_pipelines_small_variables_and_survives_a_script_flush(client):
    from qps.variables import read_many

    vs = [
        qps.Variable(f"rm{k}", (3,), np.float32, initializer="ones", client=client)
        for k in range(3)
    ]
    big = qps.Variable("rm-big", (600_000,), np.float32, initializer="zeros", client=client)
    for v in (*vs, big):
        await v.create()
    await vs[1].fence(1)
    await vs[1].publish(np.array([1, 2, 3], np.float32), 1, 1)
    got = await read_many([*vs, big])
    assert [g.value.tolist() for g in got[:3]] == [[1, 1, 1], [1, 2, 3], [1, 1, 1]]
    assert [g.version for g in got[:3]] == [(await v.read()).version for v in vs]
    assert got[3].value.shape == (600_000,) and not got[3].value.any()
    await client.commands.script_flush()  # the pipelined EVALSHAs get NOSCRIPT
    again = await read_many(vs)
    assert [g.value.tolist() for g in again] == [[1, 1, 1], [1, 2, 3], [1, 1, 1]]


async def test_small_reads_come_from_the_copy_every_write_keeps_current(
    client: qps.Client,
) -> None:
    """A small variable's create, publish and publish_rows keep ``<V>cur`` at the meta's
    ``curver``: a read gets it in one MULTI/EXEC with no bytes through Lua, equal to the
    read script's answer. A copy that is not at the variable's version (a write by an
    older qps) is not used: the read falls back to the script."""
    v = Variable("c", (6, 2), np.float32, initializer="ones", client=client)
    await v.create()

    async def by_script() -> tuple[list[Any], int]:
        got = await v._read_small()
        return got.value.tolist(), got.version

    steps = [
        v.publish(np.arange(12, dtype=np.float32).reshape(6, 2), 1, 0),
        v.publish_rows([4, 1], np.full((2, 2), -1, np.float32), 2, 0),
    ]
    for write in [None, *steps]:
        if write is not None:
            await write
        want = await by_script()
        data, curver = (
            await client.commands.get(v._prefix + "cur"),
            await client.commands.hget(v._meta, "curver"),
        )
        assert data[-16:] == b"%016x" % want[1]  # the copy ends with its version
        assert (v._array(data[:-16]).tolist(), int(curver)) == want  # kept current (cluster too)
        if not client.cluster:  # read in one MULTI: a single server's
            (got,) = await varread._read_current([v])
            assert got is not None and (got.value.tolist(), got.version) == want
    await client.commands.hset(v._meta, "curver", "1")  # as if an older writer went on
    if not client.cluster:
        assert await varread._read_current([v]) == [None]
    got = await v.read()
    assert (got.value.tolist(), got.version) == await by_script()
    assert got.version == 2 and got.value[4].tolist() == [-1, -1]
    big = Variable("big", ((varspec.CHUNK_BYTES // 4) + 1,), np.float32, client=client)
    await big.create()  # over the copy's limit: no copy kept
    assert not await client.commands.exists(big._prefix + "cur")


def test_cli_var_reads_a_parameter_of_a_packed_model(redis_url: str, cname: str) -> None:
    """`qps var ls` names the parameters a packed model stores in its parts, and `qps
    var get` reads one by its name, from the part (or parts) that hold it."""
    from qps import packing

    opts = ["--url", redis_url, "--container", cname]
    joined = np.arange(10, dtype=np.float32)

    async def go() -> None:
        async with await qps.connect(redis_url) as c:
            for name, part in (("packed/0", joined[:5]), ("packed/1", joined[5:])):
                v = qps.Variable(
                    name, (5,), np.float32, initializer=part, client=c, container=cname
                )
                await v.create()
            layout = packing.PackLayout(
                "float32", (("packed/0", 5), ("packed/1", 5)), (("W", (2, 3)), ("b", (4,)))
            )
            await packing.record_layout(c, cname, layout)

    asyncio.run(go())
    r = invoke("var", "ls", *opts)
    assert r.exit_code == 0 and "packed in packed/0, packed/1: W, b (qps var get NAME)" in r.output
    d = json.loads(invoke("var", "get", "W", *opts, "--json").output)
    assert d["shape"] == [2, 3] and d["values"] == [0, 1, 2, 3, 4, 5]
    assert d["packed_in"] == ["packed/0", "packed/1"] and d["versions"] == [0, 0]
    d = json.loads(invoke("var", "get", "b", "--rows", "1:3", *opts, "--json").output)
    assert d["values"] == [7, 8] and d["packed_in"] == ["packed/1"]
    r = invoke("var", "get", "b", *opts)
    assert r.output.startswith(f"{cname}/b: float32 [4], versions 0, packed in packed/1\n")
    r = invoke("var", "get", "nope", *opts)
    assert r.exit_code == 3


def test_the_write_script_keeps_copies_up_to_the_read_chunk() -> None:
    """The write script keeps a small value's copy (``P cur``) up to the size of one
    read chunk, the limit of :attr:`Variable.small`; the Lua states it as a number."""
    source = (Path(qps.__file__).parent / "lua" / "vars" / "write.lua").read_text()
    assert f"local CUR_MAX = {varspec.CHUNK_BYTES} " in source
