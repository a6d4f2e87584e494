"""Checkpoints (qps/checkpoint.py, qps/cli/checkpoint.py): round trips of variables of
several dtypes, partitioned variables, optimizer slots, counters, config and placement;
the snapshot's consistency under concurrent writes; corrupt checkpoints; restore into a non-empty
container; atomic directories; ``qps checkpoint save|restore|ls``.

The library tests run on both backends (fakeredis and a real server); the CLI tests on
the real server, in-process through click's CliRunner (plain functions: the commands
call ``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

import qps
from qps import checkpoint, ckfiles, keys
from qps.cli import checkpoint as cli_checkpoint
from qps.cli.main import cli
from qps.errors import DataLossError, FailedPreconditionError, NotFoundError
from qps.optimizers import Adam
from qps.ps import control
from qps.variables import open_variable
from tests.conftest import blocked_clients, until, until_blocked

C = "job"


async def _state(client: qps.Client, container: str) -> dict[str, Any]:
    """Everything a checkpoint must bring back, read from Redis."""
    out: dict[str, Any] = {}
    for n in await qps.variables.list_variables(client, container):
        v = await open_variable(client, n, container)
        st = await v.read_state()
        applied = await client.commands.zrange(
            keys.variable_applied(container, n), 0, -1, withscores=True
        )
        out[n] = (v.spec, st, applied)
    return out


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        (spec_a, st_a, ap_a), (spec_b, st_b, ap_b) = a[n], b[n]
        assert spec_a == spec_b, n
        assert (st_a.version, st_a.t) == (st_b.version, st_b.t), n
        assert st_a.value.dtype == st_b.value.dtype and st_a.value.shape == st_b.value.shape
        np.testing.assert_array_equal(st_a.value, st_b.value)
        assert st_a.slots.keys() == st_b.slots.keys(), n
        for s in st_a.slots:
            np.testing.assert_array_equal(st_a.slots[s], st_b.slots[s])
        assert ap_a == ap_b, n


async def _make_job(client: qps.Client, container: str = C) -> None:
    """A job with variables of several dtypes and shapes, a partitioned one, slots,
    applied ids, counters, a config and a placement."""
    await control.configure(client, container, 2, Adam(learning_rate=0.01))
    async with qps.Session(client=client, container=container) as s:
        w = s.variable("dense/w", (5, 3), np.float32, qps.initializers.glorot_uniform(seed=1))
        await w.create()
        b = s.variable("dense/b", (3,), np.float64, initializer="zeros")
        await b.create()
        await s.variable("half", (4,), np.float16, np.arange(4, dtype=np.float16)).create()
        await s.variable("ids", (2, 2), np.int64, np.array([[1, -2], [3, 2**40]])).create()
        await s.variable("u8", (3,), np.uint8, np.array([0, 7, 255], np.uint8)).create()
        await s.variable("flag", (), np.bool_, np.array(True)).create()
        await s.variable("names", (2,), "S5", np.array([b"ab", b"hello"])).create()
        await s.variable("empty", (0, 4), np.float32).create()
        emb = s.partitioned_variable(
            "emb",
            (10, 2),
            np.float32,
            qps.fixed_size_partitioner(3),
            qps.initializers.random_normal(seed=2),
        )
        await emb.read()
        # what a PS shard leaves: fresh slots, commits with slots, t and applied ids
        await b.init_slots({"m": np.zeros(3), "v": np.zeros(3)}, 4)
        await b.publish(
            np.array([0.5, -1.0, 2.0]),
            3,
            4,
            slots={"m": np.array([1.0, 2.0, 3.0]), "v": np.array([4.0, 5.0, 6.0])},
            applied="w0/7/1/abc.1",
            t=3,
        )
        part = await open_variable(client, "emb/part_1", container)
        await part.init_slots({"m": np.ones((3, 2)), "v": np.full((3, 2), 2.0)}, 4)
        await part.publish_rows(
            [2],
            np.array([[9.0, 8.0]]),
            1,
            4,
            slot_rows={"m": np.array([[0.5, 0.5]]), "v": np.array([[0.25, 0.25]])},
            applied="w1/3/0/abc.2",
            t=1,
        )
        await s.counter(keys.GLOBAL_STEP).add(12)
        await s.counter(keys.PS_TOKEN_COUNTER).add(4)
        await s.counter("epochs", initial=3).get()
    await control.place_variables(client, container, ["dense/w", "dense/b", "emb"])


async def test_round_trip(client: qps.Client, tmp_path: Path) -> None:
    await _make_job(client)
    before = await _state(client, C)
    info = await checkpoint.save(client, tmp_path / "ck-{step}", container=C)
    assert info.path == tmp_path / "ck-12" and info.global_step == 12
    assert info.variables == 11  # 8 plain, 3 parts
    m = info.manifest
    assert m["format"] == "qps-checkpoint" and m["qps_version"] == qps.__version__
    assert m["placement"]["dense/w"] == 0 and m["num_shards"] == 2
    assert m["partitioned"]["emb"] == {
        "full_shape": [10, 2],
        "axis": 0,
        "parts": ["emb/part_0", "emb/part_1", "emb/part_2"],
    }
    assert m["variables"]["dense/b"]["version"] == 3 and m["variables"]["dense/b"]["t"] == 3
    assert set(m["files"]) == {
        "shard-00000-of-00002.npz",
        "shard-00001-of-00002.npz",
        "unplaced.npz",
    }
    for f in m["files"]:  # plain .npz, readable without pickle
        with np.load(info.path / f, allow_pickle=False) as npz:
            assert len(npz.files) > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left
    # the pinned copies are gone
    assert not [k async for k in client.commands.scan_iter(match="*:ck:*")]

    await qps.reset(client=client, containers=[C])
    await checkpoint.restore(client, info.path)
    _same_state(await _state(client, C), before)
    assert await control.global_step_counter(client, C).get() == 12
    assert await qps.Counter("epochs", container=C, client=client).get() == 3
    cfg = await control.read_config(client, C)
    assert cfg is not None and cfg.num_shards == 2 and cfg.optimizer == Adam(learning_rate=0.01)
    assert await control.read_placement(client, C) == m["placement"]
    # the whole partitioned variable reads back as before
    pv = await qps.placement.open_partitioned_variable(client, "emb", C)
    value, _ = await pv.read()
    ck = checkpoint.load(info.path)
    np.testing.assert_array_equal(
        value, np.concatenate([ck.values[f"emb/part_{i}"] for i in range(3)])
    )


async def test_restore_into_another_container(client: qps.Client, tmp_path: Path) -> None:
    await _make_job(client)
    before = await _state(client, C)
    async with qps.Session(client=client, container=C) as s:
        info = await checkpoint.save(s, tmp_path / "ck")  # the session's container
    async with qps.Session(client=client, container="copy") as s:
        await checkpoint.restore(s, info.path)
    _same_state(await _state(client, "copy"), before)
    _same_state(await _state(client, C), before)  # the source is untouched


async def test_snapshot_is_one_instant(client: qps.Client, tmp_path: Path) -> None:
    """A writer publishes ``a`` then ``b`` at each version k (value = k, slot = -k), as a
    shard commits the variables of one message one after the other. In every snapshot
    each value matches its version and slot, and ``a`` is at most one commit ahead."""
    async with qps.Session(client=client, container=C) as s:
        a = s.variable("a", (1000,), np.float64, initializer="zeros")
        b = s.variable("b", (1000,), np.float64, initializer="zeros")
        for v in (a, b):
            await v.create()
            await v.init_slots({"m": np.zeros(1000)}, 1)
    stop = asyncio.Event()

    async def writer() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            for v in (a, b):
                await v.publish(np.full(1000, float(k)), k, 1, slots={"m": np.full(1000, -k)}, t=k)

    task = asyncio.create_task(writer())
    try:
        for i in range(5):
            await until(lambda i=i: _version_above(a, i * 3))
            ck = checkpoint.load(
                (await checkpoint.save(client, tmp_path / str(i), container=C)).path
            )
            va, vb = (ck.manifest["variables"][n] for n in ("a", "b"))
            assert va["version"] - vb["version"] in (0, 1)
            for n, meta in (("a", va), ("b", vb)):
                assert (ck.values[n] == meta["version"]).all()
                assert (ck.slots[n]["m"] == -meta["version"]).all()
                assert meta["t"] == meta["version"]
    finally:
        stop.set()
        await task


async def _version_above(v: qps.Variable, n: int) -> bool:
    return await v.version() > n


async def test_a_hold_makes_writes_wait_for_the_release(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot on Redis Cluster holds each variable while it pins them all (here on
    every backend): a publish of a held variable writes nothing and waits, blocked in
    Redis; a release by another snapshot leaves it waiting; its own lets it through. A
    hold that runs out (a saver that died) lets writes through without a release."""
    async with qps.Session(client=client, container=C) as s:
        v = s.variable("h", (4,), np.float64, initializer="zeros")
        await v.create()
    meta = keys.variable_prefix(C, "h") + "meta"
    refused: list[str] = []
    check = v._check_write

    def recording(reply: Any, *args: Any) -> None:
        refused.extend(["held"] if reply[0] in (b"held", "held") else [])
        check(reply, *args)

    monkeypatch.setattr(v, "_check_write", recording)
    await client.run_script(checkpoint.SNAPSHOT, [meta], ["s1", 60_000, 60_000])
    task = asyncio.create_task(v.publish(np.ones(4), 1, 1))
    await until(lambda: _true(refused))
    await until_blocked(client, task=task, what="the refused publish blocked in BLPOP")
    assert await client.run_script(checkpoint.RELEASE, [meta], ["s2"]) == 0
    # another snapshot's release left s1's hold in place and woke no one: still waiting
    assert await client.commands.hget(meta, "hold_by") == b"s1"
    assert await blocked_clients(client) >= 1 and refused == ["held"]
    assert not task.done() and await v.version() == 0
    assert await client.run_script(checkpoint.RELEASE, [meta], ["s1"]) == 1
    await asyncio.wait_for(task, 10)
    got = await v.read()
    assert got.version == 1 and (got.value == 1).all()

    refused.clear()
    await client.run_script(checkpoint.SNAPSHOT, [meta], ["s3", 60_000, 300])
    await asyncio.wait_for(v.publish_rows([2], [7.0], 2, 1), 10)  # no release: it runs out
    got = await v.read()
    assert refused == ["held"] and got.version == 2 and got.value.tolist() == [1, 1, 7, 1]


async def _true(xs: list[str]) -> bool:
    return bool(xs)


# -- refusals ----------------------------------------------------------------------------------


async def test_corrupt_checkpoints_are_refused(client: qps.Client, tmp_path: Path) -> None:
    await _make_job(client)
    info = await checkpoint.save(client, tmp_path / "good", container=C)
    await qps.reset(client=client, containers=[C])

    def copy(name: str) -> Path:
        dst = tmp_path / name
        dst.mkdir()
        for f in info.path.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        return dst

    flipped = copy("flipped")
    data = flipped / "shard-00000-of-00002.npz"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(DataLossError, match=r"shard-00000-of-00002\.npz is corrupt"):
        await checkpoint.restore(client, flipped)

    missing = copy("missing")
    (missing / "unplaced.npz").unlink()
    with pytest.raises(DataLossError, match=r"unplaced\.npz is missing"):
        await checkpoint.restore(client, missing)

    lying = copy("lying")  # a manifest edited by hand: the arrays disagree with it
    m = json.loads((lying / "manifest.json").read_text())
    m["variables"]["dense/w"]["spec"]["shape"] = [3, 5]
    (lying / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataLossError, match="manifest says float32 \\[3, 5\\]"):
        await checkpoint.restore(client, lying)

    pickled = copy("pickled")  # an object array needs pickle: never loaded
    m = json.loads((pickled / "manifest.json").read_text())
    with zipfile.ZipFile(pickled / "unplaced.npz", "a") as z, z.open("evil.npy", "w") as f:
        np.lib.format.write_array(f, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    path = pickled / "unplaced.npz"
    m["files"]["unplaced.npz"]["sha256"] = ckfiles.sha256(path)
    name = next(n for n, v in m["variables"].items() if v["file"] == "unplaced.npz")
    m["variables"][name]["value"] = "evil"
    (pickled / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataLossError, match="pickle"):
        await checkpoint.restore(client, pickled)

    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "manifest.json").write_text("{")
    with pytest.raises(DataLossError, match="unreadable manifest"):
        await checkpoint.restore(client, tmp_path / "notjson")
    with pytest.raises(NotFoundError, match="no checkpoint"):
        await checkpoint.restore(client, tmp_path / "nowhere")
    # nothing was written by any refused restore
    assert await checkpoint.container_is_empty(client, C)
    assert [i.path.name for i in checkpoint.list_checkpoints(tmp_path)] == [
        "flipped",
        "good",
        "lying",
        "missing",
        "pickled",
    ]


async def test_restore_refuses_a_non_empty_container(client: qps.Client, tmp_path: Path) -> None:
    await _make_job(client)
    info = await checkpoint.save(client, tmp_path / "ck", container=C)
    await control.global_step_counter(client, C).add(5)
    await qps.Counter("other-job", container=C, client=client).get()
    with pytest.raises(FailedPreconditionError, match="container 'job' is not empty"):
        await checkpoint.restore(client, info.path)
    assert await control.global_step_counter(client, C).get() == 17  # unchanged
    await checkpoint.restore(client, info.path, overwrite=True)
    assert await control.global_step_counter(client, C).get() == 12
    assert "other-job" not in await qps.containers.list_counters(client, C)


async def test_save_refusals_and_listing(client: qps.Client, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="holds no variables"):
        await checkpoint.save(client, tmp_path / "x", container=C)
    assert not (tmp_path / "x").exists()
    await _make_job(client)
    first = await checkpoint.save(client, tmp_path / "a", container=C)
    with pytest.raises(FailedPreconditionError, match="exists already"):
        await checkpoint.save(client, tmp_path / "a", container=C)
    await control.global_step_counter(client, C).add(30)
    second = await checkpoint.save(client, tmp_path / "0-later", container=C)
    assert [i.global_step for i in checkpoint.list_checkpoints(tmp_path)] == [12, 42]
    assert checkpoint.latest(tmp_path) == second.path
    assert checkpoint.latest(tmp_path / "a") == first.path  # a checkpoint itself
    (tmp_path / "empty").mkdir()
    assert checkpoint.latest(tmp_path / "empty") is None
    with pytest.raises(NotFoundError):
        checkpoint.list_checkpoints(tmp_path / "nowhere")


# -- the command line (real server) ----------------------------------------------------------


def invoke(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def _setup(url: str, container: str) -> None:
    async def go() -> None:
        async with await qps.connect(url) as c:
            await _make_job(c, container)

    asyncio.run(go())


def _global_step(url: str, container: str) -> int:
    async def go() -> int:
        async with await qps.connect(url) as c:
            return await control.global_step_counter(c, container).get()

    return asyncio.run(go())


def test_cli_save_ls_restore(redis_url: str, tmp_path: Path, monkeypatch: Any) -> None:
    c = f"cktest-{secrets.token_hex(4)}"
    _setup(redis_url, c)
    where = ["--url", redis_url, "--container", c]
    r = invoke("checkpoint", "save", str(tmp_path / "m-{step}"), *where)
    assert r.exit_code == 0, r.output
    assert f"saved container '{c}' at global step 12 to {tmp_path / 'm-12'}" in r.output
    r = invoke("checkpoint", "save", str(tmp_path / "m-{step}"), *where)
    assert r.exit_code == 1 and "exists already" in r.output
    r = invoke("checkpoint", "save", str(tmp_path / "j"), "--json", *where)
    assert r.exit_code == 0
    assert json.loads(r.output)["global_step"] == 12

    r = invoke("checkpoint", "ls", str(tmp_path))
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["PATH", "STEP", "CREATED"] and len(lines) == 3
    assert str(tmp_path / "j") in r.output and " 12 " in lines[1]
    r = invoke("checkpoint", "ls", str(tmp_path), "--json")
    assert [d["global_step"] for d in json.loads(r.output)] == [12, 12]
    assert invoke("checkpoint", "ls", str(tmp_path / "nowhere")).exit_code == 3

    # restore into the (non-empty) source container: refused without a terminal
    r = invoke("checkpoint", "restore", str(tmp_path / "m-12"), "--url", redis_url)
    assert r.exit_code == 2 and "pass --yes" in r.output
    monkeypatch.setattr(cli_checkpoint, "_interactive", lambda: True)
    r = invoke("checkpoint", "restore", str(tmp_path / "m-12"), "--url", redis_url, input="n\n")
    assert r.exit_code == 1 and "not confirmed" in r.output
    r = invoke("checkpoint", "restore", str(tmp_path / "m-12"), "--url", redis_url, input="y\n")
    assert r.exit_code == 0, r.output
    assert f"into container '{c}'" in r.output
    monkeypatch.setattr(cli_checkpoint, "_interactive", lambda: False)
    r = invoke("checkpoint", "restore", str(tmp_path / "m-12"), "--yes", *where, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["restored_into"] == c
    assert _global_step(redis_url, c) == 12

    # into an empty container: no question asked
    other = c + "-b"
    r = invoke(
        "checkpoint", "restore", str(tmp_path / "j"), "--url", redis_url, "--container", other
    )
    assert r.exit_code == 0, r.output
    assert _global_step(redis_url, other) == 12

    # corrupt: exit 1, nothing written; no checkpoint: exit 3
    data = tmp_path / "j" / "unplaced.npz"
    data.write_bytes(data.read_bytes()[:-10])
    third = c + "-c"
    r = invoke(
        "checkpoint", "restore", str(tmp_path / "j"), "--url", redis_url, "--container", third
    )
    assert r.exit_code == 1 and "unplaced.npz is corrupt" in r.output
    r = invoke("checkpoint", "restore", str(tmp_path), "--url", redis_url)
    assert r.exit_code == 3 and "no checkpoint" in r.output

    async def empty() -> bool:
        async with await qps.connect(redis_url) as cl:
            return await checkpoint.container_is_empty(cl, third)

    assert asyncio.run(empty())
    r = invoke(
        "checkpoint", "save", str(tmp_path / "none"), "--url", redis_url, "--container", third
    )
    assert r.exit_code == 3
    assert not os.path.exists(tmp_path / "none")


def test_cli_is_registered() -> None:
    r = invoke("checkpoint", "--help")
    assert r.exit_code == 0
    for cmd in ("save", "restore", "ls"):
        assert cmd in r.output
