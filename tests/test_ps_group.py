"""Group commits of a PS shard (qps/ps/shard.py): several messages applied to the
in-memory state and committed once per variable give exactly the state that applying
them one by one gives, and a shard that dies between the apply and the commit, or
between the commit and the ack, loses nothing and applies nothing twice.

The in-process tests run on both backends; the SIGKILL tests use real processes on a
real server (as tests/test_ps_exactly_once.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qps
from qps import checkpoint, keys
from qps.embedded import EmbeddedServer
from qps.errors import InternalError, UnavailableError
from qps.optimizers import SGD, Adam, Optimizer
from qps.ps import control
from qps.ps import shard as shard_module
from qps.ps.gradlist import gradient_list_key
from qps.ps.shard import Shard, ShardOptions
from qps.variables import Variable
from tests.conftest import ClientFactory, cancel_all, until, within

C = "grp"
REPO = str(Path(__file__).resolve().parents[1])
N = 12  # messages
# a running shard renews its lease every third of it: 5 s leaves a loaded machine room
# for a stall (a shard that ends releases its lease, so the next one does not wait)
LEASE_MS = 5000
ROWS = 20


def _grads(k: int) -> dict[str, Any]:
    """Message k: a dense gradient of "w" and sparse rows of "emb" (repeats included),
    small integers in float64, so that SGD sums are exact in any order."""
    rng = np.random.default_rng(100 + k)
    ids = rng.integers(0, ROWS, 5)
    ids[1] = ids[0]
    return {
        "w": rng.integers(-3, 4, 6).astype(np.float64),
        "emb": (ids, rng.integers(-3, 4, (5, 3)).astype(np.float64)),
    }


def _reference(opt: Optimizer) -> dict[str, np.ndarray]:
    """Values and slots after applying the N messages one by one, in order."""
    w, emb = np.zeros(6), np.zeros((ROWS, 3))
    sw, se = opt.init_slots(w), opt.init_slots(emb)
    for k in range(N):
        g = _grads(k)
        opt.apply_dense(w, g["w"], sw, k + 1)
        opt.apply_sparse(emb, g["emb"][0], g["emb"][1], se, k + 1)
    out = {"w": w, "emb": emb}
    out.update({f"w/{n}": s for n, s in sw.items()})
    out.update({f"emb/{n}": s for n, s in se.items()})
    return out


async def _setup(client: qps.Client, opt: Optimizer) -> None:
    await control.configure(client, C, 1, opt, queue_capacity=64)  # room for N messages
    async with qps.Session(client=client, container=C) as s:
        await s.variable("w", (6,), np.float64, initializer="zeros").create()
        await s.variable("emb", (ROWS, 3), np.float64, initializer="zeros").create()
    await control.place_variables(client, C, ["w", "emb"])


@pytest.fixture(params=["queue", "list"])
def channel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the gradients travel: the shard's gradient queue (as on a Redis Cluster) or
    its gradient list (a single server's; qps.ps.gradlist)."""
    if request.param == "queue":
        request.getfixturevalue("queue_path")
    elif request.node.callspec.params.get("make_client") == "cluster":
        pytest.skip("the gradient list serves a single server")
    return str(request.param)


async def _waiting(client: qps.Client, channel: str) -> int:
    """Messages waiting for the shard on ``channel``."""
    if channel == "queue":
        return await control.gradient_queue(client, C, 0, 64).size()
    waiting = await client.commands.lrange(gradient_list_key(C, 0), 0, -1)
    return len([m for m in waiting if m])  # not the wake-up `mark_finished` pushes


async def _push_all(client: qps.Client) -> None:
    """Fill the gradient queue with the N messages (no shard runs yet)."""
    async with qps.Session(client=client, container=C, worker="w0") as s:
        for k in range(N):
            await s.push(_grads(k), step=k)


async def _check_state(client: qps.Client, opt: Optimizer, versions: int = N) -> None:
    want = _reference(opt)
    for name in ("w", "emb"):
        st = await (await qps.variables.open_variable(client, name, C)).read_state()
        np.testing.assert_array_equal(st.value, want[name])  # bit for bit
        for n in opt.slot_names():
            np.testing.assert_array_equal(st.slots[n], want[f"{name}/{n}"])
        assert st.version == versions and st.t == versions, name
        # every id was released after the ack
        assert await client.commands.zcard(keys.variable_applied(C, name)) == 0
    assert await control.global_step_counter(client, C).get() == versions
    assert await control.dead_letters(client, C, 0) == []


async def _drain(client: qps.Client, **kw: Any) -> Shard:
    """Run a shard until the finished job's queue is drained."""
    await control.mark_finished(client, C)
    shard = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS, **kw))
    assert await asyncio.wait_for(shard.run(), 60) == "finished"
    return shard


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[qps.Client]:
    yield await make_client()


@pytest.mark.parametrize("lazy", [False, True], ids=["adam", "lazy-adam"])
async def test_a_group_equals_one_by_one(client: qps.Client, lazy: bool) -> None:
    opt = Adam(learning_rate=0.1, lazy=lazy)
    await _setup(client, opt)
    await _push_all(client)
    shard = await _drain(client, commit_interval_ms=60_000)
    st = await control.shard_status(client, C, 0)
    groups = int(await client.commands.hget(keys.ps_prefix(C, 0) + "stats", "groups") or 0)
    assert shard.applied == st.applied == N and 1 <= groups < N  # messages were grouped
    await _check_state(client, opt)


async def test_max_group_1_commits_each_message(client: qps.Client) -> None:
    opt = Adam(learning_rate=0.1)
    await _setup(client, opt)
    await _push_all(client)
    await _drain(client, max_group=1)
    groups = int(await client.commands.hget(keys.ps_prefix(C, 0) + "stats", "groups") or 0)
    assert groups == N
    await _check_state(client, opt)


@pytest.mark.parametrize("spread", [0, shard_module.COMMIT_SPREAD])
async def test_slow_commits_keep_groups_open_longer(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, spread: int
) -> None:
    """commit_interval_ms=0 with one message read ahead commits each message alone;
    after a commit that took long (a large variable), the group stays open for
    COMMIT_SPREAD times as long, and takes every message queued meanwhile."""
    opt = Adam(learning_rate=0.1)
    monkeypatch.setattr(shard_module, "READ_AHEAD_BYTES", 1)
    monkeypatch.setattr(shard_module, "COMMIT_SPREAD", spread)
    await _setup(client, opt)
    await _push_all(client)
    await control.mark_finished(client, C)
    shard = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS, commit_interval_ms=0))
    shard._commit_seconds = 30.0  # as if the last commit had taken 30 s (capped: 2 s)
    assert await asyncio.wait_for(shard.run(), 60) == "finished"
    groups = int(await client.commands.hget(keys.ps_prefix(C, 0) + "stats", "groups") or 0)
    assert groups == N if spread == 0 else groups <= 2
    await _check_state(client, opt)


@pytest.mark.no_cluster(reason="commits go at once on a single server (keys of many slots)")
async def test_commits_sent_at_once_survive_a_flushed_script_cache(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, queue_path: None
) -> None:
    """Small dense commits go in one round trip, their scripts by SHA: after SCRIPT FLUSH
    (a restarted server forgets its scripts) they come back NOSCRIPT, did not run, and
    are committed again the usual way: the state is exact, nothing applied twice."""
    opt = Adam(learning_rate=0.1)  # TF1 Adam: the sparse variable commits whole too
    await _setup(client, opt)
    await _push_all(client)
    real = type(client).run_commands_replies
    calls: list[int] = []

    async def flushing(self: qps.Client, commands: Any) -> list[Any]:
        if not any("glist" in str(x) for c in commands for x in c):  # the list reader's
            calls.append(len(commands))
        if len(calls) in (1, 3):  # the scripts are gone before these batches
            await self.commands.script_flush()
        return await real(self, commands)

    monkeypatch.setattr(type(client), "run_commands_replies", flushing)
    await _drain(client, max_group=1)
    assert len(calls) >= N - 2  # one batch per group, after the fallbacks loaded them
    assert all(n > 2 for n in calls)  # both variables and the global step in each
    await _check_state(client, opt)


async def test_commits_wait_while_a_checkpoint_holds_the_variables(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a snapshot holds the variables (as on Redis Cluster), the shard's commits are
    refused ('held') and wait, blocked in Redis; on a single server the commits sent at
    once come back refused and go again the usual way. Released, the state is exact."""
    opt = Adam(learning_rate=0.1)
    await _setup(client, opt)
    shard = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS, max_group=1))
    run = asyncio.create_task(shard.run())
    await until(lambda: _owns_both(shard))
    metas = [keys.variable_prefix(C, n) + "meta" for n in ("w", "emb")]
    for m in metas:
        await client.commands.eval(checkpoint._SNAPSHOT, 1, m, "s1", 60_000, 60_000)
    refused: list[str] = []
    real = Variable._check_write

    def recording(self: Variable, reply: Any, *args: Any) -> None:
        if reply[0] in (b"held", "held"):
            refused.append(self.name)
        real(self, reply, *args)

    monkeypatch.setattr(Variable, "_check_write", recording)
    try:
        await _push_all(client)
        await until(lambda: _both(refused))
        for name in ("w", "emb"):
            assert await (await qps.variables.open_variable(client, name, C)).version() == 0
        assert not run.done()
        for m in metas:
            assert await client.commands.eval(checkpoint._RELEASE, 1, m, "s1") == 1
        await control.mark_finished(client, C)
        assert await asyncio.wait_for(run, 60) == "finished"
    finally:
        await cancel_all([run])
    await _check_state(client, opt)


async def _owns_both(shard: Shard) -> bool:
    return set(shard.owned) == {"w", "emb"}


async def _both(refused: list[str]) -> bool:
    return set(refused) == {"w", "emb"}


@pytest.mark.parametrize("max_group", [64, 4])
async def test_a_failed_group_commit_leaves_nothing_applied(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, max_group: int, channel: str
) -> None:
    """The commit of the first variable fails after the group was applied in memory:
    the state in Redis is unchanged, the messages go back, the next run applies them.
    With groups of 4, others were read ahead of the failed group: all go back in the
    queue's order (Adam's state is bit for bit the one-by-one one only in that order)."""
    opt = Adam(learning_rate=0.1)
    await _setup(client, opt)
    await _push_all(client)
    await control.mark_finished(client, C)
    first = Shard(
        client,
        ShardOptions(
            0, 1, container=C, lease_ms=LEASE_MS, commit_interval_ms=60_000, max_group=max_group
        ),
    )
    real, real_at_once = Shard._commit, Shard._commit_at_once

    async def broken(self: Shard, *args: Any) -> None:
        raise UnavailableError("Redis went away (test)")

    # both ways of committing: one variable at a time, and all small ones at once
    monkeypatch.setattr(Shard, "_commit", broken)
    monkeypatch.setattr(Shard, "_commit_at_once", broken)
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(first.run(), 60)
    assert first.owned == {}  # the changed copies were dropped
    for name in ("w", "emb"):
        st = await (await qps.variables.open_variable(client, name, C)).read_state()
        assert st.version == 0 and not st.value.any()
    assert await _waiting(client, channel) == N  # all back, in order
    monkeypatch.setattr(Shard, "_commit", real)
    monkeypatch.setattr(Shard, "_commit_at_once", real_at_once)
    second = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS))
    assert await asyncio.wait_for(second.run(), 60) == "finished"
    assert second.applied == N
    await _check_state(client, opt)


async def _committed_not_acked(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, opt: Optimizer
) -> None:
    """The N messages of a finished job, committed as a group by a shard whose ack then
    failed: every variable recorded them, and they wait to be delivered again."""
    await _setup(client, opt)
    await _push_all(client)
    await control.mark_finished(client, C)
    first = Shard(
        client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS, commit_interval_ms=60_000)
    )
    real = Shard._settle

    async def no_ack(self: Shard, q: Any, ds: Any, *, ack: bool, **kw: Any) -> bool:
        if ack:
            raise UnavailableError("Redis went away (test)")
        return await real(self, q, ds, ack=ack, **kw)

    monkeypatch.setattr(Shard, "_settle", no_ack)
    with pytest.raises(UnavailableError):
        await within(first.run(), 60, "the first shard's ack fails")
    monkeypatch.setattr(Shard, "_settle", real)


async def test_an_ack_lost_after_the_group_commit_skips_the_redelivery(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, channel: str
) -> None:
    """Every variable committed the group, then the ack failed: the messages come
    back and are all skipped (their ids are recorded); nothing is applied twice."""
    opt = Adam(learning_rate=0.1)
    await _committed_not_acked(client, monkeypatch, opt)
    assert await _waiting(client, channel) == N
    second = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS))
    assert await asyncio.wait_for(second.run(), 60) == "finished"
    assert (second.applied, second.skipped) == (0, N)
    await _check_state(client, opt)


async def test_a_look_up_that_misses_an_applied_message_stops_the_shard(
    client: qps.Client, monkeypatch: pytest.MonkeyPatch, channel: str
) -> None:
    """The commit refuses a redelivered message that the look-up of the applied ids said
    was not applied (here the look-up is made to miss): the shard stops with an
    InternalError naming the message, instead of delivering the group again and again
    (each delivery refused the same way: a livelock) or applying it twice."""
    await _committed_not_acked(client, monkeypatch, SGD(learning_rate=1.0))

    async def missed(self: Shard, msgs: Any) -> tuple[list[dict[str, bool]], list[bool]]:
        return [dict.fromkeys(m.grads, False) for m in msgs], [False] * len(msgs)

    monkeypatch.setattr(Shard, "_applied_flags", missed)
    second = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS))
    with pytest.raises(InternalError, match="did not find it"):
        await within(second.run(), 30, "the shard stops on the refused redelivery")
    st = await (await qps.variables.open_variable(client, "w", C)).read_state()
    assert st.version == N  # applied once, by the first shard


# -- real processes, SIGKILL ---------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    run_dir = tempfile.mkdtemp(prefix="qpsgrp", dir="/tmp")
    srv = EmbeddedServer(run_dir=run_dir)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["before-commit", "before-ack"])
async def test_a_shard_killed_inside_a_group_loses_nothing(
    server: EmbeddedServer, when: str
) -> None:
    """A shard process SIGKILLs itself with a group of N messages applied in memory
    (``before-commit``) or committed but not acknowledged (``before-ack``); the next
    shard (after the deliveries' leases run out) leaves exactly the one-by-one state.
    SGD: the messages may come back in another order (the queue puts each expired
    delivery back at the front), and the sums are exact in any order."""
    opt = SGD(learning_rate=1.0)
    client = await qps.connect(server.url)
    try:
        await _setup(client, opt)
        await _push_all(client)
        env = {**os.environ, "QPS_LEASE_MS": "3000", "PYTHONPATH": REPO}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, os.path.join(REPO, "tests", "ps_worker.py"), "--crash-shard",
            server.url, C, when,
            env=env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == -9, out
        assert f"killing myself {when} a group of {N} message(s)" in out.decode()
        committed = when == "before-ack"
        st = await (await qps.variables.open_variable(client, "w", C)).read_state()
        assert st.version == (N if committed else 0)
        # the next shard gets the messages back once their deliveries' leases run out
        second = Shard(client, ShardOptions(0, 1, container=C, lease_ms=LEASE_MS))
        task = asyncio.create_task(second.run())

        async def redelivered() -> bool:
            assert not task.done(), task
            return second.applied + second.skipped >= N

        await until(redelivered, timeout=30)
        await control.mark_finished(client, C)
        assert await asyncio.wait_for(task, 30) == "finished"
        assert (second.applied, second.skipped) == ((0, N) if committed else (N, 0))
        await _check_state(client, opt)
    finally:
        await client.close()


async def test_the_read_ahead_never_loses_a_wake_up() -> None:
    """The reader puts a message and at once waits for room again, before the applier's
    wait has started: the applier still wakes (a shared event cleared by each waiter
    lost this wake-up, and the group then stayed open until commit_interval_ms)."""
    inbox = shard_module._Inbox(max_items=1, max_bytes=1 << 30)
    item = shard_module._Item(None, nbytes=1)

    async def reader() -> None:
        inbox.put(item)
        await inbox.until(lambda: not inbox.full(), 30)

    applier = asyncio.ensure_future(inbox.until(lambda: bool(inbox.items), 30))
    feeding = asyncio.ensure_future(reader())
    try:
        await asyncio.wait_for(asyncio.shield(applier), 5)
        assert list(inbox.items) == [item]
        assert inbox.take() is item  # room again: the reader wakes too
        await asyncio.wait_for(feeding, 5)
    finally:
        await cancel_all([applier, feeding])
