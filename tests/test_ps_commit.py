"""A PS shard's commit: value + optimizer slots + applied-message id in one script
(qps/variables.py: init_slots, read_state, publish/publish_rows with slots=...)."""

from __future__ import annotations

import numpy as np
import pytest

from qps import keys
from qps.errors import FailedPreconditionError, InvalidArgumentError
from qps.transport import Client
from qps.variables import AlreadyAppliedError, StaleTokenError, Variable

pytestmark = pytest.mark.asyncio


async def _var(client: Client, shape: tuple[int, ...] = (6, 2)) -> Variable:
    v = Variable(
        "w",
        shape,
        np.float64,
        initializer=np.arange(np.prod(shape), dtype=np.float64).reshape(shape),
        container="c",
        client=client,
    )
    return await v.create()


async def test_init_slots_and_read_state(client: Client) -> None:
    v = await _var(client)
    st = await v.read_state()
    assert st.version == 0 and st.slots == {} and st.t == 0
    await v.fence(5)
    await v.init_slots({"m": np.zeros((6, 2)), "v": np.full((6, 2), 0.5)}, 5)
    st = await v.read_state()
    assert list(st.slots) == ["m", "v"] and st.version == 0 and st.t == 0
    np.testing.assert_array_equal(st.slots["v"], 0.5)
    np.testing.assert_array_equal(st.value, np.arange(12.0).reshape(6, 2))
    with pytest.raises(StaleTokenError):
        await v.init_slots({"m": np.zeros((6, 2))}, 4)


async def test_commit_is_atomic_and_skips_a_message_applied_before(client: Client) -> None:
    v = await _var(client)
    await v.init_slots({"m": np.zeros((6, 2))}, 1)
    new = np.ones((6, 2))
    await v.publish(new, 1, 1, slots={"m": np.full((6, 2), 3.0)}, applied="w/0/0/a.1", t=1)
    st = await v.read_state()
    assert st.version == 1 and st.t == 1
    np.testing.assert_array_equal(st.value, new)
    np.testing.assert_array_equal(st.slots["m"], 3.0)
    assert await client.commands.zscore(keys.variable_applied("c", "w"), "w/0/0/a.1") is not None
    # the same message again (a redelivery after a crash): refused, nothing changes
    with pytest.raises(AlreadyAppliedError, match="already applied"):
        await v.publish(new * 7, 2, 1, slots={"m": np.zeros((6, 2))}, applied="w/0/0/a.1", t=2)
    st = await v.read_state()
    assert st.version == 1 and st.t == 1
    np.testing.assert_array_equal(st.value, new)
    np.testing.assert_array_equal(st.slots["m"], 3.0)
    # nothing of the refused commit is left behind: one value and one slot generation
    found = [k async for k in client.commands.scan_iter(match="qps:{c/v/w}:*")]
    names = sorted(k.decode().split("}:")[1].split(":")[0] for k in found)
    assert names.count("o") == 1  # the slot segment of the current generation
    assert names.count("d") <= 2  # current (+ the previous one kept for readers)


async def test_commit_rows_with_slot_rows(client: Client) -> None:
    v = await _var(client)
    await v.init_slots({"m": np.zeros((6, 2)), "v": np.zeros((6, 2))}, 2)
    await v.publish_rows(
        [4, 1],
        [[40.0, 41.0], [10.0, 11.0]],
        1,
        2,
        slot_rows={"m": [[4.0, 4.0], [1.0, 1.0]], "v": [[-4.0, -4.0], [-1.0, -1.0]]},
        applied="x",
        t=9,
    )
    st = await v.read_state()
    assert st.version == 1 and st.t == 9
    want = np.arange(12.0).reshape(6, 2)
    want[4], want[1] = [40, 41], [10, 11]
    np.testing.assert_array_equal(st.value, want)
    assert st.slots["m"][4].tolist() == [4, 4] and st.slots["m"][0].tolist() == [0, 0]
    assert st.slots["v"][1].tolist() == [-1, -1]
    with pytest.raises(AlreadyAppliedError):
        await v.publish_rows(
            [0],
            [[9.0, 9.0]],
            2,
            2,
            slot_rows={"m": [[9.0, 9.0]], "v": [[9.0, 9.0]]},
            applied="x",
            t=10,
        )
    assert (await v.read_state()).value[0].tolist() == [0, 1]
    # workers' row reads see the new rows with the version
    rows, ver = await v.read_rows([4])
    assert ver == 1 and rows.tolist() == [[40, 41]]


async def test_commit_refuses_other_slots_and_stale_tokens(client: Client) -> None:
    v = await _var(client)
    await v.init_slots({"m": np.zeros((6, 2))}, 3)
    with pytest.raises(FailedPreconditionError, match=r"slots are \[m\]"):
        await v.publish(np.zeros((6, 2)), 1, 3, slots={"accum": np.zeros((6, 2))}, applied="a", t=1)
    await v.fence(4)
    with pytest.raises(StaleTokenError):
        await v.publish(np.zeros((6, 2)), 1, 3, slots={"m": np.zeros((6, 2))}, applied="a", t=1)
    with pytest.raises(StaleTokenError):
        await v.publish_rows(
            [0], [[0.0, 0.0]], 1, 3, slot_rows={"m": [[0.0, 0.0]]}, applied="a", t=1
        )
    st = await v.read_state()
    assert st.version == 0
    assert await client.commands.zcard(keys.variable_applied("c", "w")) == 0


async def test_plain_publish_keeps_the_slots(client: Client) -> None:
    v = await _var(client)
    await v.init_slots({"m": np.full((6, 2), 2.0)}, 1)
    await v.publish(np.zeros((6, 2)), 1, 1)
    st = await v.read_state()
    np.testing.assert_array_equal(st.slots["m"], 2.0)
    np.testing.assert_array_equal(st.value, 0.0)


async def test_large_variable_commit_over_several_segments(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qps import varspec

    monkeypatch.setattr(varspec, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(varspec, "CHUNK_BYTES", 1024)
    v = Variable("big", (1000, 4), np.float64, initializer="zeros", container="c", client=client)
    await v.create()
    assert v._layout.nseg > 1
    await v.init_slots({"a": np.zeros((1000, 4))}, 1)
    val = np.random.default_rng(1).random((1000, 4))
    await v.publish(val, 1, 1, slots={"a": val * 2}, applied="m1", t=1)
    st = await v.read_state()
    np.testing.assert_array_equal(st.value, val)
    np.testing.assert_array_equal(st.slots["a"], val * 2)
    idx = np.array([0, 511, 999])
    await v.publish_rows(
        idx, np.ones((3, 4)), 2, 1, slot_rows={"a": np.full((3, 4), 5.0)}, applied="m2", t=2
    )
    st = await v.read_state()
    np.testing.assert_array_equal(st.value[idx], 1.0)
    np.testing.assert_array_equal(st.slots["a"][idx], 5.0)
    np.testing.assert_array_equal(st.slots["a"][1], val[1] * 2)


async def test_a_group_commit_records_every_id_or_none(client: Client) -> None:
    """A group commit names several messages: all their ids are recorded with the
    value, and a group that names one id already recorded changes nothing."""
    v = await _var(client)
    await v.init_slots({"m": np.zeros((6, 2))}, 1)
    applied = keys.variable_applied("c", "w")
    ids = ["w/0/0/a.1", "w/1/0/a.2", "w/2/0/a.3"]
    await v.publish(np.ones((6, 2)), 3, 1, slots={"m": np.ones((6, 2))}, applied=ids, t=3)
    st = await v.read_state()
    assert (st.version, st.t) == (3, 3)
    assert sorted(m.decode() for m in await client.commands.zrange(applied, 0, -1)) == ids
    with pytest.raises(AlreadyAppliedError, match=r"w/1/0/a\.2"):
        await v.publish(
            np.zeros((6, 2)), 5, 1, slots={"m": np.zeros((6, 2))}, applied=["x.9", ids[1]], t=5
        )
    with pytest.raises(AlreadyAppliedError):
        await v.publish_rows(
            [0], np.zeros((1, 2)), 5, 1, slot_rows={"m": np.zeros((1, 2))}, applied=["x.9", ids[2]]
        )
    st = await v.read_state()
    assert (st.version, st.t) == (3, 3) and st.value.sum() == 12
    assert await client.commands.zscore(applied, "x.9") is None
    # rows: two new ids at once
    await v.publish_rows(
        [1, 4], np.full((2, 2), 5.0), 5, 1, slot_rows={"m": np.full((2, 2), 6.0)},
        applied=["y.1", "y.2"], t=5,
    )  # fmt: skip
    st = await v.read_state()
    assert (st.version, st.t) == (5, 5) and st.value[4].tolist() == [5.0, 5.0]
    assert st.slots["m"][1].tolist() == [6.0, 6.0] and st.slots["m"][0].tolist() == [1.0, 1.0]
    assert await client.commands.zcard(applied) == 5
    with pytest.raises(InvalidArgumentError, match="distinct"):
        await v.publish(np.ones((6, 2)), 6, 1, slots={"m": np.ones((6, 2))}, applied=["a", "a"])
