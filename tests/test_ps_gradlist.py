"""qps.ps.gradlist: the lean gradient channel of synchronous training (a list, a
processing list per owner, tombstones, give-back and reclaim), and a synchronous job
through it: exactly once across a shard that dies holding messages; both backends."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from qps import keys
from qps.errors import CancelledError, UnavailableError
from qps.optimizers import SGD
from qps.ps import control
from qps.ps.gradlist import TOMBSTONE, WAKE, GradientList, is_list_delivery
from qps.ps.messages import decode_message
from qps.ps.settle import _coalesced
from tests.conftest import cancel_all, until
from tests.test_ps_shard import C, Job, job  # noqa: F401  (the fixture)

pytestmark = pytest.mark.no_cluster(reason="the gradient list serves a single server")


async def _push(client, gl: GradientList, *values: bytes) -> None:
    await client.run_commands([gl.push_command(v) for v in values])


async def _items(client, key: str) -> list[bytes]:
    return list(await client.commands.lrange(key, 0, -1))


LEASE = "gl-test-lease"


async def _owner(client, token: int, shard: int = 0) -> GradientList:
    """A list consumer holding lease ``token`` (as a shard does)."""
    await client.commands.set(LEASE, f"{token} test-owner")
    gl = GradientList(client, C, shard)
    await gl.open(token, LEASE)
    return gl


async def test_take_ack_in_and_out_of_order(make_client) -> None:
    client = await make_client()
    gl = GradientList(client, C, 0)
    await _push(client, gl, b"m0", b"m1", b"m2")
    await client.commands.set(LEASE, "7 test-owner")
    assert await gl.open(7, LEASE) == 0
    assert gl.proc is not None and gl.proc.endswith(":proc:7")
    ds = [await gl.take(1) for _ in range(3)]
    assert all(d is not None and is_list_delivery(d) for d in ds)
    assert [bytes(d.value) for d in ds] == [b"m0", b"m1", b"m2"]  # type: ignore[union-attr]
    assert await gl.size() == 0 and await _items(client, gl.proc) == [b"m0", b"m1", b"m2"]
    d0, d1, d2 = ds
    assert await gl.ack([d2])  # behind two held ones: a tombstone in place, bytes freed
    assert await _items(client, gl.proc) == [b"m0", b"m1", TOMBSTONE]
    await gl.ack([d0])
    assert await _items(client, gl.proc) == [b"m1", TOMBSTONE]
    await gl.ack([d1], after=[("SET", "gl-after", "1")])  # pops through the tombstone
    assert await _items(client, gl.proc) == []
    assert await client.commands.get("gl-after") == b"1"  # in the same round trip
    await gl.ack([d1])  # again: nothing
    # a later take lands at the index the shard expects
    await _push(client, gl, b"m3", b"m4")
    d3, d4 = await gl.take(1), await gl.take(1)
    assert d3 is not None and d4 is not None
    await gl.ack([d4])
    proc = gl.proc
    assert await _items(client, proc) == [b"m3", TOMBSTONE]
    await gl.close()  # gives m3 back, forgets the processing list
    assert gl.proc is None and not await client.commands.exists(proc)
    assert await _items(client, gl.key) == [b"m3"]
    assert not await client.commands.exists(gl.procs)


async def test_a_take_times_out_and_a_wake_up_is_no_message(make_client) -> None:
    client = await make_client()
    gl = await _owner(client, 1, shard=1)
    assert await gl.take(0.05) is None
    await _push(client, gl, WAKE, b"m")
    assert await gl.take(1) is None  # the wake-up, acknowledged at once
    d = await gl.take(1)
    assert d is not None and bytes(d.value) == b"m"
    assert await _items(client, gl.proc) == [b"m"]  # type: ignore[arg-type]


async def test_give_back_puts_what_is_held_at_the_front_in_order(make_client) -> None:
    client = await make_client()
    gl = await _owner(client, 3)
    await _push(client, gl, b"a", b"b", b"c", b"d")
    a, b, _ = await gl.take(1), await gl.take(1), await gl.take(1)
    assert a is not None and b is not None
    await gl.ack([b])  # done: not given back
    assert await gl.give_back() == 2
    assert await _items(client, gl.key) == [b"a", b"c", b"d"]
    assert not await client.commands.exists(gl.proc)


async def test_a_new_owner_puts_back_what_earlier_owners_hold_and_they_cannot_pop(
    make_client,
) -> None:
    client = await make_client()
    first = await _owner(client, 1)
    await _push(client, first, b"1", b"2", b"3", b"4", b"5")
    assert [bytes(d.value) for d in [await first.take(1), await first.take(1)]] == [b"1", b"2"]  # type: ignore[union-attr]
    assert await GradientList(client, C, 0).held() == 2
    second = await _owner(client, 2)  # the first "died": its messages go back
    assert await _items(client, second.key) == [b"1", b"2", b"3", b"4", b"5"]
    assert await second.held() == 0
    got = await second.take(1)
    assert got is not None and bytes(got.value) == b"1"
    # the first is a zombie: a take of its own still lands in its list, and its pop is
    # refused (the lease holds token 2)
    late = await first.take(1)
    assert late is not None and bytes(late.value) == b"2"
    assert await first.ack([late]) is False
    assert await _items(client, first.proc) == [b"2"]  # type: ignore[arg-type]
    assert await second.held() == 1
    assert await second.reclaim() == 1  # what the lease's renewals do
    assert await _items(client, second.key) == [b"2", b"3", b"4", b"5"]
    await first.take(1)  # and once more, then a third owner comes
    third = await _owner(client, 3)
    # both earlier lists go back, the oldest owner's messages first
    assert await _items(client, third.key) == [b"2", b"1", b"3", b"4", b"5"]
    assert {n.decode() for n in await client.commands.smembers(third.procs)} == {
        first.proc,
        second.proc,
        third.proc,
    }
    await third.close()  # a clean stop forgets its own name only
    assert len(await client.commands.smembers(third.procs)) == 2


async def test_sync_pushes_go_through_the_list(job: Job) -> None:  # noqa: F811
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    gl = GradientList(a.client, C, 0)
    await a.push({"w": np.array([1, 2], np.float32)}, step=0)  # before any shard runs
    assert await gl.size() == 1
    assert decode_message(await a.client.commands.lindex(gl.key, 0)).worker == "w0"
    assert await control.gradient_queue(a.client, C, 0).size() == 0
    assert (await control.shard_status(a.client, C, 0)).queue_size == 1
    from workers import monitor

    snap = await monitor.snapshot(a.client, C)  # `qps top` counts it as waiting
    assert [row.lag for row in snap.shards] == [1]
    await b.push({"w": np.array([3, 4], np.float32)}, step=0)
    shard, task = await job.shard(0, 1)
    tok = control.tokens(a.client, C, 0)
    assert (await tok.take_then([], 10))[0] == 1
    assert (await a.pull("w")).value.tolist() == [-2.0, -3.0]
    await control.mark_finished(a.client, C)  # wakes the shard blocked on its list
    assert await asyncio.wait_for(task, 10) == "finished"
    assert shard.applied == 2 and await gl.size() == 0
    assert not await a.client.commands.exists(gl.procs)  # a clean stop forgets its list
    with pytest.raises(CancelledError, match="finished"):
        await a.push({"w": np.array([1, 1], np.float32)}, step=1)


async def test_a_sync_update_is_popped_by_its_token_script(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a single server a synchronous update's messages leave the processing list in
    the commit's round trip (the token script pops them once the update is committed):
    no ack of their own; the stats and the ids' releases kept meanwhile are sent once
    the shard is idle, and count every update."""
    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0), sync=(1, 1))
    await sess.variable("w", (2,), np.float32, initializer="zeros").create()
    acks: list[int] = []
    real_ack = GradientList.ack

    async def counted_ack(self: GradientList, ds: Any, after: Any = ()) -> bool:
        acks.append(len(ds))
        return await real_ack(self, ds, after)

    monkeypatch.setattr(GradientList, "ack", counted_ack)
    shard, task = await job.shard(0, 1)
    tok = control.tokens(sess.client, C, 0)
    gl = GradientList(sess.client, C, 0)
    for step in range(5):
        await sess.push({"w": np.array([1, 2], np.float32)}, step=step)
        assert (await tok.take_then([], 10))[0] == step + 1
    assert (await sess.pull("w")).value.tolist() == [-5.0, -10.0]
    assert acks == []  # none acknowledged alone
    (proc,) = [p for p in await sess.client.commands.smembers(gl.procs)]
    assert await sess.client.commands.llen(proc) == 0  # popped by the updates' scripts
    stats = keys.ps_prefix(C, 0) + "stats"

    async def counted() -> bool:  # sent once the shard waited RELEASE_IDLE_S
        return int(await sess.client.commands.hget(stats, "applied") or 0) == 5

    await until(counted)
    applied = keys.variable_applied(C, "w")
    assert await sess.client.commands.zcard(applied) == 0  # the ids released
    await control.mark_finished(sess.client, C)
    assert await asyncio.wait_for(task, 10) == "finished"
    assert shard.applied == 5 and await gl.size() == 0


def test_releases_and_stats_are_coalesced() -> None:
    """What a shard keeps to send later goes in as few commands as do the same."""
    kept = [
        ("ZREM", "a", "m1", "m2"),
        ("ZREM", "b", "m1"),
        ("HINCRBY", "s", "applied", 2),
        ("HINCRBY", "s", "rows", 0),
        ("HSET", "s", "last_ms", 1, "held_bytes", 9),
        ("ZREM", "a", "m3", "m2"),
        ("HINCRBY", "s", "applied", 1),
        ("HSET", "s", "last_ms", 2, "first_ms", 1),
        ("RPUSH", "c", "x"),
    ]
    assert _coalesced(kept) == [
        ("ZREM", "a", "m1", "m2", "m3"),
        ("ZREM", "b", "m1"),
        ("HINCRBY", "s", "applied", 3),
        ("HSET", "s", "last_ms", 2, "held_bytes", 9, "first_ms", 1),
        ("RPUSH", "c", "x"),
    ]


@pytest.mark.parametrize("how", ["lost", "refused", "refused with the tokens"])
async def test_messages_held_by_a_stopped_or_dead_shard_are_applied_once(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """A shard that stops after committing an update whose pop was lost (an error) or
    refused (the lease no longer holds its token: in the ack's own round trip, or in
    the token script that pops an update's messages on a single server) gives the
    message back and keeps its ids; a shard that dies holding messages leaves them in
    its processing list. The next owner puts both back, finds the committed one in the
    applied ids (skipped) and applies the other once."""
    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0), sync=(1, 1))
    await sess.variable("w", (2,), np.float32, initializer="zeros").create()
    real_ack = GradientList.ack
    answers: list[bool] = []

    async def no_ack(self: GradientList, ds: object, after: object = ()) -> bool:
        if how == "lost":  # as if the process died between the commit and the pop
            raise UnavailableError("the pop was lost (test)")
        token, self._token = self._token, 1 << 50  # a token the lease does not hold
        try:
            answers.append(await real_ack(self, ds, after))  # type: ignore[arg-type]
        finally:
            self._token = token
        return answers[-1]

    real_front = GradientList.front_ack

    def front_ack(self: GradientList, ds: Any) -> Any:
        if how != "refused with the tokens":  # the pop goes in a round trip of its own
            return None
        got = real_front(self, ds)
        assert got is not None  # on a single server, an update's message at the front
        return got[0], [1 << 50, *got[1][1:]]  # a token the lease does not hold

    monkeypatch.setattr(GradientList, "ack", no_ack)
    monkeypatch.setattr(GradientList, "front_ack", front_ack)
    shard, task = await job.shard(0, 1)
    tok = control.tokens(sess.client, C, 0)
    await sess.push({"w": np.array([1, 1], np.float32)}, step=0)
    assert (await tok.take_then([], 10))[0] == 1
    shard.request_stop()
    assert await asyncio.wait_for(task, 10) == "stopped"
    assert answers == ([False] if how == "refused" else [])
    monkeypatch.setattr(GradientList, "ack", real_ack)
    monkeypatch.setattr(GradientList, "front_ack", real_front)
    gl = GradientList(sess.client, C, 0)
    assert await gl.size() == 1  # given back: committed, never popped
    await sess.push({"w": np.array([2, 2], np.float32)}, step=1)
    dead = GradientList(await job.make_client(), C, 0)
    await dead.open(1 << 40, "no-lease")  # then takes both and is "killed"
    assert await dead.take(1) is not None and await dead.take(1) is not None
    assert await gl.size() == 0 and await gl.held() == 2
    shard, task = await job.shard(0, 1)
    assert (await tok.take_then([], 10))[0] == 2
    assert (await sess.pull("w")).value.tolist() == [-3.0, -3.0]  # 1 + 2, each once
    assert await sess.global_step() == 2
    await control.mark_finished(sess.client, C)
    assert await asyncio.wait_for(task, 10) == "finished"
    assert shard.skipped == 1 and shard.applied == 1
    assert await gl.size() == 0 and await gl.held() == 0


async def test_a_sync_push_to_two_shards_brings_the_token_back(job: Job) -> None:  # noqa: F811
    """push_then to two shards: the token's wait rides with shard 0's message, and the
    other shard's push (no commands of its own) leaves its replies alone (it once
    emptied them: the worker then waited for a token it had already taken)."""
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 2, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    await a.variable("v", (2,), np.float32, initializer="zeros").create()
    await control.place_variables(a.client, C, ["w", "v"], "round_robin")
    assert await control.read_placement(a.client, C) == {"w": 0, "v": 1}
    await job.shard(0, 2)
    await job.shard(1, 2)
    one = {"w": np.ones(2, np.float32), "v": np.ones(2, np.float32)}
    await b.push(one, step=0)
    tok = control.tokens(a.client, C, 0)
    ids, replies = await a.ps.push_then(one, [tok.wait_command(10)], step=0, blocking=True)
    assert sorted(ids) == [0, 1]
    if replies:  # a real server: the wait ran in the push's round trip
        assert control.Tokens.taken(replies) == 1
    else:  # fakeredis (no lean connection): it did not run, and the token waits
        assert (await tok.take_then([], 10))[0] == 1
    assert (await a.pull("v")).value.tolist() == [-1.0, -1.0]


async def test_a_message_over_the_list_limit_goes_through_the_queue(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large synchronous message goes through the gradient queue (in chunks), and the
    shard reads both: an update may mix them."""
    from qps.ps import client as ps_client

    monkeypatch.setattr(ps_client, "LIST_MAX_BYTES", 400)
    a, b = await job.session("w0"), await job.session("w1")
    await control.configure(a.client, C, 1, SGD(learning_rate=1.0), sync=(2, 2))
    await a.variable("w", (2,), np.float32, initializer="zeros").create()
    await a.variable("big", (100,), np.float32, initializer="zeros").create()
    gl, q = GradientList(a.client, C, 0), control.gradient_queue(a.client, C, 0)
    await a.push({"w": np.ones(2, np.float32)}, step=0)  # small: the list
    await b.push({"w": np.ones(2, np.float32), "big": np.ones(100, np.float32)}, step=0)
    assert await gl.size() == 1 and await q.size() == 1
    await job.shard(0, 1)
    assert (await control.tokens(a.client, C, 0).take_then([], 10))[0] == 1
    assert (await a.pull("w")).value.tolist() == [-1.0, -1.0]
    # each variable's accumulator averages the gradients it got (one here)
    assert (await a.pull("big")).value.tolist() == [-1.0] * 100


# -- asynchronous training: the list with credits ---------------------------------------


async def test_take_many_takes_what_waits_in_one_round_trip(make_client) -> None:
    client = await make_client()
    gl = await _owner(client, 3)
    await _push(client, gl, b"m0", b"m1", WAKE, b"m2", b"m3", b"m4")
    got = await gl.take_many(4, 1)  # none known to wait: blocks for the first
    assert [bytes(d.value) for d in got] == [b"m0"] and gl.waiting == 5
    got = await gl.take_many(3, 1)  # three at once; the wake-up among them is dropped
    assert [bytes(d.value) for d in got] == [b"m1", b"m2"] and gl.waiting == 2
    got += await gl.take_many(10, 1)
    assert [bytes(d.value) for d in got] == [b"m1", b"m2", b"m3", b"m4"] and gl.waiting == 0
    assert await gl.take_many(10, 0.05) == []  # none came
    assert gl.proc is not None
    assert await _items(client, gl.proc) == [b"m0", b"m1", TOMBSTONE, b"m2", b"m3", b"m4"]
    await gl.ack(got)  # the front stays: m0 is not done
    assert await _items(client, gl.proc) == [b"m0", *[TOMBSTONE] * 5]


async def test_async_pushes_go_through_the_list_and_wait_for_credits(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asynchronous training on a single server: pushes go onto the shard's list; a
    worker with the job's queue_capacity messages unsettled waits for a credit, which
    the shard gives back for each message it settles: applied, or dead-lettered."""
    from qps.ps.client import PSClient
    from qps.ps.gradlist import credit_key

    waits: list[int] = []
    real_wait = PSClient._wait_credit

    async def counted(self: PSClient, shard: int, key: str) -> None:
        waits.append(self._unsettled[shard])
        await real_wait(self, shard, key)

    monkeypatch.setattr(PSClient, "_wait_credit", counted)
    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0), queue_capacity=2)
    await sess.variable("w", (2,), np.float64, initializer="zeros").create()
    gl, q = GradientList(sess.client, C, 0), control.gradient_queue(sess.client, C, 0, 2)
    await sess.push({"w": np.array([1.0, 1.0])}, step=0)
    await sess.push({"w": np.array([np.nan, 1.0])}, step=1)  # poison: dead-lettered
    assert await gl.size() == 2 and await q.size() == 0 and waits == []
    st = await control.shard_status(sess.client, C, 0)
    assert st.queue_size == 2 and st.queue_bytes == sum(
        len(x) for x in await _items(sess.client, gl.key)
    )
    third = asyncio.create_task(sess.push({"w": np.array([2.0, 2.0])}, step=2))
    try:
        await until_true(lambda: bool(waits))  # the window is full: it waits
        assert waits == [2] and await gl.size() == 2
        shard, _ = await job.shard(0, 1)
        await asyncio.wait_for(third, 30)  # a credit came back
        await _until_step(sess, 2)
    finally:
        await cancel_all([third])
    assert (await sess.pull("w")).value.tolist() == [-3.0, -3.0]
    assert shard.dead == 1 and shard.applied == 2
    # a credit back for each of the three: those not picked up yet wait in the list
    left = await sess.client.commands.llen(credit_key(C, 0, "w0"))
    assert left == sess.ps._unsettled[0] <= 2


async def test_a_push_waiting_for_a_credit_ends_when_the_job_finishes(
    job: Job,  # noqa: F811
) -> None:
    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0), queue_capacity=1)
    await sess.variable("w", (2,), np.float64, initializer="zeros").create()
    await sess.push({"w": np.ones(2)}, step=0)  # the window is full, no shard runs
    blocked = asyncio.create_task(sess.push({"w": np.ones(2)}, step=1))
    try:
        await until_true(lambda: sess.ps._unsettled.get(0) == 1)
        await control.mark_finished(sess.client, C)
        with pytest.raises(CancelledError, match="finished"):
            await asyncio.wait_for(blocked, 30)
    finally:
        await cancel_all([blocked])
    sent = await _items(sess.client, GradientList(sess.client, C, 0).key)
    assert len([m for m in sent if m != WAKE]) == 1  # the second was never sent


async def test_async_messages_a_dead_shard_held_are_applied_once(job: Job) -> None:  # noqa: F811
    from qps.ps.gradlist import credit_key

    """A shard killed holding a message it took from the list: its successor, started
    after the job was marked finished, puts it back and applies it once before it
    finishes, and every message's credit comes back."""
    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    for k in range(3):
        await sess.push({"w": np.full(1, 10.0**k)}, step=k)
    first, task = await job.shard(0, 1)
    await _until_step(sess, 3)
    first.request_stop()
    assert await asyncio.wait_for(task, 10) == "stopped"
    await sess.push({"w": np.full(1, 1000.0)}, step=3)
    dead = GradientList(await job.make_client(), C, 0)
    await dead.open(1 << 40, "no-lease")  # takes it, then is "killed"
    assert len(await dead.take_many(5, 1)) == 1
    gl = GradientList(sess.client, C, 0)
    assert await gl.size() == 0 and await gl.held() == 1
    await control.mark_finished(sess.client, C)
    shard, task = await job.shard(0, 1)
    assert await asyncio.wait_for(task, 30) == "finished"
    assert (await sess.pull("w")).value.tolist() == [-1111.0] and await sess.global_step() == 4
    assert shard.applied == 1 and await gl.size() == 0 and await gl.held() == 0
    credits = await sess.client.commands.llen(credit_key(C, 0, "w0"))
    assert credits == sess.ps._unsettled[0]  # four given back, the rest picked up


async def until_true(pred) -> None:
    async def check() -> bool:
        return bool(pred())

    await until(check)


async def _until_step(sess, n: int) -> None:
    async def reached() -> bool:
        return await sess.global_step() >= n

    await until(reached, timeout=30)


async def test_a_push_after_the_end_takes_its_message_back_unless_it_was_taken(
    job: Job,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A push that finds the job finished (its RPUSH went in the same round trip)
    withdraws its message and raises CancelledError: nothing is applied that the worker
    does not count. If the shard took the message first, it will be applied: the push
    returns as sent."""
    from qps.ps.client import PSClient

    sess = await job.session("w0")
    await control.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (2,), np.float64, initializer="zeros").create()
    gl = GradientList(sess.client, C, 0)
    await control.mark_finished(sess.client, C)
    with pytest.raises(CancelledError, match="finished"):
        await sess.push({"w": np.ones(2)}, step=0)
    assert await _items(sess.client, gl.key) == [WAKE]  # the shard's wake-up alone
    taken: list[object] = []
    real = PSClient._withdrawn

    async def shard_first(self: PSClient, g: GradientList, payload: bytes) -> bool:
        consumer = await _owner(await job.make_client(), 5)
        while not taken:  # the wake-up (dropped), then the message
            taken.extend(await consumer.take_many(5, 1))
        return await real(self, g, payload)

    monkeypatch.setattr(PSClient, "_withdrawn", shard_first)
    ids = await sess.push({"w": np.ones(2)}, step=1)
    assert list(ids) == [0] and len(taken) == 1
    assert decode_message(bytes(taken[0].value)).id == ids[0]  # type: ignore[attr-defined]


async def test_take_each_sends_the_takes_at_once_and_yields_each_as_it_comes(
    make_client,
) -> None:
    """Synchronous training's reader: an update's takes in one write. A message already
    waiting comes at once, a later one when it is pushed (its take waited in Redis
    meanwhile), a take with nothing to take gives None after its own timeout, and the
    processing list holds the messages in the order they were yielded."""
    client = await make_client()
    gl = await _owner(client, 4)
    await _push(client, gl, b"m0")
    got = []
    async for d in gl.take_each(2, 5, then=5):
        got.append(None if d is None else bytes(d.value))
        if len(got) == 1:  # the second take waits in Redis: push its message now
            await _push(await make_client(), gl, b"m1")
    assert got == [b"m0", b"m1"]
    got = [d async for d in gl.take_each(2, 0.05, then=0.05)]
    assert got == [None, None]
    await _push(client, gl, WAKE, b"m2")
    got = [None if d is None else bytes(d.value) async for d in gl.take_each(2, 1, then=1)]
    assert got == [None, b"m2"]  # the wake-up is no message
    assert gl.proc is not None
    assert await _items(client, gl.proc) == [b"m0", b"m1", TOMBSTONE, b"m2"]
    await gl.close()
    assert await _items(client, gl.key) == [b"m0", b"m1", b"m2"]
