"""``dequeue_then``: plain commands that ride with a dequeue and run right after the
element is taken (a sync worker's token wait and parameter read in one round trip),
``enqueue_then`` (an async worker's push and next pull in one round trip), and the size
and variable reads built for them (``size_commands``, ``ReadPlan``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import qps
from qps.ps.client import PSClient
from qps.variables import read_plan
from tests.conftest import until


def _pending_dequeues(q: qps.FIFOQueue, n: int):
    async def check() -> bool:
        return (await q.stats()).pending_dequeues == n

    return check


async def test_commands_run_after_the_element_is_taken(client):
    q = qps.FIFOQueue(10, np.int64, shapes=[[]], client=client)
    await q.enqueue_many(np.array([5, 6, 7], np.int64))
    value, replies = await q.dequeue_then(q.size_commands())
    assert int(value) == 5
    assert q.size_of(replies) == 2 == await q.size()  # read after the take
    value, replies = await q.dequeue_then([])
    assert (int(value), replies) == (6, [])


async def test_a_blocked_dequeue_reads_after_the_wake(make_client):
    a, b = await make_client(), await make_client()
    qa = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="tokens", client=a)
    qb = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="tokens", client=b)
    waiter = asyncio.create_task(qa.dequeue_then(qa.size_commands(), timeout=20))
    await until(_pending_dequeues(qb, 1))
    await qb.enqueue_many(np.array([1, 2, 3], np.int64))  # one for it, two left
    value, replies = await waiter
    assert int(value) == 1
    assert qa.size_of(replies) == 2
    assert [int(v) for v in await qb.dequeue_many(2)] == [2, 3]
    assert (await qb.stats()).pending_dequeues == 0


async def test_an_error_reply_comes_in_place_and_the_element_is_kept(client):
    q = qps.FIFOQueue(10, np.int64, shapes=[[]], client=client)
    await q.enqueue_many(np.array([1, 2], np.int64))
    wrong = (b"LLEN", q._keys[0])  # the meta hash: WRONGTYPE
    value, replies = await q.dequeue_then([wrong, *q.size_commands()])
    assert int(value) == 1
    assert isinstance(replies[0], Exception)
    assert q.size_of(replies[1:]) == 1
    assert q.size_of([replies[0]]) is None and q.size_of([]) is None
    assert int(await q.dequeue()) == 2


async def test_a_timed_out_dequeue_then_changes_nothing(client):
    q = qps.FIFOQueue(10, np.int64, shapes=[[]], client=client)
    with pytest.raises(qps.errors.DeadlineExceededError):
        await q.dequeue_then(q.size_commands(), timeout=0.2)
    s = await q.stats()
    assert (s.size, s.pending_dequeues) == (0, 0)
    await q.enqueue(np.int64(9))
    assert int(await q.dequeue()) == 9


@pytest.mark.parametrize("nbytes", [8, 40_000])  # inline, and out of line in one chunk
async def test_enqueue_then_reads_after_the_element_is_in(client, nbytes):
    q = _raw_queue(client)
    first = np.arange(nbytes, dtype=np.int64).astype(np.uint8)
    assert q.size_of(await q.enqueue_then(first, q.size_commands())) == 1
    assert q.size_of(await q.enqueue_then(first[:3], q.size_commands())) == 2
    assert await q.enqueue_then(first[:1], []) == []
    assert (await q.dequeue()).tobytes() == first.tobytes()  # its bytes, whole
    typed = qps.FIFOQueue(10, np.int64, shapes=[[]], client=client)  # the checked path
    await typed.enqueue(np.int64(1))
    assert typed.size_of(await typed.enqueue_then(np.int64(2), typed.size_commands())) == 2
    with pytest.raises(qps.errors.InvalidArgumentError):  # nothing sent, nothing in
        await typed.enqueue_then(np.zeros(2, np.int64), typed.size_commands())
    assert [int(v) for v in await typed.dequeue_many(2)] == [1, 2] and await typed.size() == 0


async def test_a_blocked_enqueue_then_reads_after_the_room_comes(make_client):
    a, b = await make_client(), await make_client()
    qa = qps.FIFOQueue(1, [np.uint8], shared_name="full", client=a)
    qb = qps.FIFOQueue(1, [np.uint8], shared_name="full", client=b)
    await qb.enqueue(np.zeros(20_000, np.uint8))
    pusher = asyncio.create_task(
        qa.enqueue_then(np.ones(20_000, np.uint8), qa.size_commands(), timeout=20)
    )

    async def blocked() -> bool:
        return (await qb.stats()).pending_enqueues == 1

    await until(blocked)
    assert not (await qb.dequeue()).any()
    replies = await pusher
    assert qa.size_of(replies) == 1  # read once its element was in
    assert (await qb.dequeue()).all() and await qb.size() == 0
    await qb.close()
    with pytest.raises(qps.errors.CancelledError):  # closed: nothing in, nothing read
        await qa.enqueue_then(np.ones(3, np.uint8), qa.size_commands())


@pytest.mark.no_cluster(reason="its token list is of another slot than the queue's")
async def test_blocking_enqueue_then_waits_once_on_its_own_connection(make_client):
    """A synchronous worker's push: the element in, then a BLPOP for its token and a
    read, in one round trip on a connection of their own (other calls go on meanwhile)."""
    a, b = await make_client(), await make_client()
    qa = qps.FIFOQueue(2, [np.uint8], shared_name="grads", client=a)
    qb = qps.FIFOQueue(2, [np.uint8], shared_name="grads", client=b)
    token = qps.keys.container_prefix(qps.keys.DEFAULT_CONTAINER) + "t:0"
    wait = [(b"BLPOP", token, 20), *qa.size_commands()]
    pusher = asyncio.create_task(qa.enqueue_then(np.ones(20_000, np.uint8), wait, blocking=True))
    if a._endpoint is None:  # no lean connections (fakeredis): the commands do not run
        assert await pusher == [] and await qb.size() == 1
        return

    async def element_in() -> bool:
        return await qb.size() == 1

    await until(element_in)  # in, while the BLPOP blocks on the pusher's connection
    assert await qa.size() == 1 and not pusher.done()  # the client serves other calls
    await b.run_commands([(b"RPUSH", token, b"7")])
    replies = await pusher
    assert replies[0] == [token.encode(), b"7"] and qa.size_of(replies[1:]) == 1
    # on a full queue the wait runs first, then the enqueue waits for room
    await qb.enqueue(np.zeros(5, np.uint8))
    await b.run_commands([(b"RPUSH", token, b"8")])
    third = asyncio.create_task(qa.enqueue_then(np.full(5, 2, np.uint8), wait, blocking=True))

    async def blocked() -> bool:
        return (await qb.stats()).pending_enqueues == 1

    await until(blocked)
    assert (await qb.dequeue()).all()
    replies = await third
    assert replies[0] == [token.encode(), b"8"] and qa.size_of(replies[1:]) == 2
    assert (await qb.dequeue()).tolist() == [0] * 5 and (await qb.dequeue()).tolist() == [2] * 5
    await qb.close()
    with pytest.raises(qps.errors.CancelledError):  # raised once the wait is done
        await qa.enqueue_then(np.ones(3, np.uint8), [(b"BLPOP", token, 0.05)], blocking=True)


@pytest.mark.parametrize("kind", ["fifo", "shuffle", "priority", "padding"])
async def test_size_commands_agree_with_size(client, kind):
    if kind == "shuffle":
        q = qps.RandomShuffleQueue(20, 0, np.int64, shapes=[[]], seed=1, client=client)
        await q.enqueue_many(np.arange(6, dtype=np.int64))
    elif kind == "priority":
        q = qps.PriorityQueue(20, np.int64, shapes=[[]], client=client)
        await q.enqueue_many((np.arange(6, dtype=np.int64), np.arange(6, dtype=np.int64)))
    elif kind == "padding":
        q = qps.PaddingFIFOQueue(20, np.int64, shapes=[[None]], client=client)
        await q.enqueue_many(np.zeros((6, 3), np.int64))
    else:
        q = qps.FIFOQueue(20, np.int64, shapes=[[]], client=client)
        await q.enqueue_many(np.arange(6, dtype=np.int64))
    _, replies = await q.dequeue_then(q.size_commands())
    assert q.size_of(replies) == await q.size() == 5


@pytest.mark.no_cluster(reason="a read plan is for a single server (read_plan gives None)")
async def test_a_read_plan_reads_what_pull_reads(client):
    w = await qps.Variable("w", (2, 3), np.float32, initializer="ones", client=client).create()
    b = await qps.Variable("b", (3,), np.float32, client=client).create()
    ps = PSClient(client, qps.keys.DEFAULT_CONTAINER)
    plan = await ps.pull_plan(["w", "b"])
    assert plan is not None
    got = ps.pulled(plan, await client.run_commands_replies(plan.commands))
    assert got is not None
    want = await ps.pull(["w", "b"])
    for name in ("w", "b"):
        assert np.array_equal(got[name].value, want[name].value)
        assert got[name].version == want[name].version
    # a commit moves the version; the plan's next read sees it
    await w.publish(np.full((2, 3), 2.0, np.float32), got["w"].version + 1, 0)
    again = ps.pulled(plan, await client.run_commands_replies(plan.commands))
    assert again is not None and again["w"].version == got["w"].version + 1
    assert again["w"].value.tolist() == [[2.0] * 3] * 2
    # replies that are not the plan's give None (pull then), never a wrong value
    assert plan.values([]) is None
    assert plan.values([b"OK", *[b"QUEUED"] * 4, [None, None, None, None]]) is None
    assert read_plan([]) is None and read_plan([b]) is not None


@pytest.mark.no_cluster(reason="the plan reads variables of another slot than the queue's")
async def test_an_element_and_the_parameters_in_one_round_trip(make_client):
    """Block for an element and read the parameters the moment it is taken: the read
    sees the commit made before the element was put."""
    a, b = await make_client(), await make_client()
    w = await qps.Variable("w", (4,), np.float32, client=a).create()
    shard_w = await qps.Variable("w", (4,), np.float32, client=b).create()
    ps = PSClient(a, qps.keys.DEFAULT_CONTAINER)
    plan = await ps.pull_plan(["w"])
    assert plan is not None
    steps_a = qps.FIFOQueue(-1, [np.int64], shapes=[[]], shared_name="steps", client=a)
    steps_b = qps.FIFOQueue(-1, [np.int64], shapes=[[]], shared_name="steps", client=b)
    waiter = asyncio.create_task(
        steps_a.dequeue_then([*steps_a.size_commands(), *plan.commands], timeout=20)
    )
    await until(_pending_dequeues(steps_b, 1))
    await shard_w.publish(np.full(4, 3.0, np.float32), 1, 0)
    await steps_b.enqueue(np.int64(1))
    step, replies = await waiter
    assert int(step) == 1
    n = len(steps_a.size_commands())
    assert steps_a.size_of(replies[:n]) == 0
    got = ps.pulled(plan, replies[n:])
    assert got is not None and got["w"].value.tolist() == [3.0] * 4
    assert got["w"].version == (await w.read()).version


# -- several elements in one acknowledged attempt (a PS shard that fell behind) -----------


def _raw_queue(client, name="grads"):
    return qps.FIFOQueue(10, [np.uint8], shared_name=name, client=client)  # no shapes


async def test_ready_acked_takes_what_is_there_in_one_delivery(client):
    q = _raw_queue(client)
    msgs = [np.frombuffer(bytes([k]) * (k + 1), np.uint8) for k in range(5)]
    for m in msgs:
        await q.enqueue(m)
    d, replies = await q.dequeue_ready_acked(3, then=q.size_commands())
    assert [v.tobytes() for v in d.value] == [m.tobytes() for m in msgs[:3]]
    assert len(d.tokens) == 1 and q.size_of(replies) == 2 == await q.size()
    await q.nack(d)  # all three back at the front, in order
    d, _ = await q.dequeue_ready_acked(8)  # fewer there than asked: what there is
    assert [v.tobytes() for v in d.value] == [m.tobytes() for m in msgs]
    await q.ack(d)
    s = await q.stats()
    assert (s.size, s.dequeued_total) == (0, 5)
    with pytest.raises(qps.errors.WouldBlockError):
        await q.dequeue_ready_acked(2)
    assert (await q.stats()).pending_dequeues == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(qps.errors.InvalidArgumentError):
            await q.dequeue_ready_acked(bad)
    await q.close()
    with pytest.raises(qps.errors.OutOfRangeError):
        await q.dequeue_ready_acked(2)


async def test_acked_then_reads_after_the_take_and_keeps_the_lease(client):
    q = _raw_queue(client)
    await q.enqueue(np.arange(3, dtype=np.uint8))
    await q.enqueue(np.arange(4, dtype=np.uint8))
    d, replies = await q.dequeue_acked_then(q.size_commands())
    assert d.value.tolist() == [0, 1, 2] and q.size_of(replies) == 1
    await q.nack(d)
    assert (await q.dequeue()).tolist() == [0, 1, 2]  # it went back to the front


@pytest.mark.parametrize("acked", [True, False])
async def test_takes_in_pairs_send_each_attempt_with_its_wait(make_client, monkeypatch, acked):
    """An acknowledged consumer whose takes come in pairs, the first of which waits (a
    synchronous shard gathering two workers' gradients), sends every attempt with its
    wait in one round trip (``script_then_wait``) once one of its last two takes
    waited: the second of a pair finds its element, the first of the next pair waits
    again. A plain one does so only after a take that waited."""
    from qps.transport import Client

    a, b = await make_client(), await make_client()
    if not a.pipelined_blocking or a._endpoint is None:
        pytest.skip("one round trip for an attempt and its wait needs a waiter connection")
    together: list[int] = []
    real = Client.script_then_wait

    async def counted(self: Client, *args, **kwargs):
        together.append(1)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(Client, "script_then_wait", counted)
    qa = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="pairs", client=a)
    qb = qps.FIFOQueue(10, np.int64, shapes=[[]], shared_name="pairs", client=b)

    async def take() -> int:
        if not acked:
            return int(await qa.dequeue(timeout=20))
        d = await qa.dequeue_acked(timeout=20)
        await qa.ack(d)
        return int(d.value)

    taken, sent_together = [], []
    for pair in range(3):
        first = asyncio.create_task(take())
        await until(_pending_dequeues(qb, 1))  # it waits
        await qb.enqueue_many(np.array([2 * pair, 2 * pair + 1], np.int64))
        taken += [await first, await take()]
        sent_together.append(len(together))
    assert taken == list(range(6))
    # the very first take is sent alone; every acknowledged one after it goes with its
    # wait, of the plain ones only those after a take that waited
    assert sent_together == ([1, 3, 5] if acked else [1, 2, 3])
