"""Cancelling a blocked dequeue at every point of its life.

A blocked call goes through several awaits (its first script, the wait on its wake key,
the collect after a wake-up, the abort that withdraws it); a cancellation that lands on
one of them and is swallowed leaves the task running on, so that whoever cancelled and
awaits it waits forever (a lost cancellation), and a withdrawal that loses its held
elements breaks exactly-once. Each case below cancels after a different number of
event-loop turns (and, in the race cases, in the same turns as an enqueue from another
client wakes the call), then checks that the task ends promptly with CancelledError or a
delivery, that nothing is lost or delivered twice, and that the queue holds no waiter."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
import pytest

import qps
from tests.conftest import until

I64 = np.int64
#: A cancelled call must end within this: at a load average of 26 on 2 cores, the
#: slowest took 0.5 s; a lost cancellation never ends.
PROMPT = 10.0
TURNS = [0, 1, 2, 3, 5, 8, 13, 21, 34]


@pytest.fixture(autouse=True)
def _counted_cancellations(request: pytest.FixtureRequest) -> None:
    # fakeredis sends under asyncio.wait_for, which loses cancellations before 3.12;
    # qps gets them back from the task's count, which Python 3.10 does not keep
    if sys.version_info < (3, 11) and "fakeredis" in request.node.name:
        pytest.skip("Python 3.10 keeps no count of a task's cancellations (CPython gh-86296)")


def make(kind: str, client: Any, name: str) -> Any:
    if kind == "fifo":
        return qps.FIFOQueue(10, I64, shapes=[[]], shared_name=name, client=client)
    if kind == "shuffle":
        return qps.RandomShuffleQueue(10, 1, I64, shapes=[[]], shared_name=name, client=client)
    return qps.PaddingFIFOQueue(10, I64, shapes=[[None]], shared_name=name, client=client)


def element(kind: str, v: int) -> Any:
    return np.array([v], I64) if kind == "padding" else I64(v)


def value(kind: str, got: Any) -> list[int]:
    a = np.asarray(got)
    return [int(x) for x in a.reshape(-1)] if kind != "padding" else [int(a[0])]


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def ended(task: asyncio.Task[Any], what: str) -> None:
    await asyncio.wait([task], timeout=PROMPT)
    assert task.done(), f"{what}: still running {PROMPT:g} s after cancel() (a lost cancellation)"


async def drained(q: Any, kind: str) -> list[int]:
    """Everything left in ``q`` (closed first, so that nothing waits any more)."""
    await q.close()
    out: list[int] = []
    while await q.size():
        out += value(kind, await q.dequeue())
    return out


@pytest.mark.parametrize("kind", ["fifo", "shuffle", "padding"])
async def test_a_cancelled_blocked_dequeue_ends_at_once_at_any_point(client, kind):
    """A dequeue of an empty queue (or, for the shuffle queue, one held back by
    min_after_dequeue), cancelled after ``n`` turns: it raises CancelledError promptly,
    leaves no waiter behind, and the elements it may have held go back."""
    for n in TURNS:
        q = make(kind, client, f"cancel-{kind}-{n}")
        if kind == "shuffle":
            await q.enqueue(element(kind, 7))  # one element, held back by min_after 1
        task = asyncio.ensure_future(q.dequeue())
        await turns(n)
        task.cancel()
        await ended(task, f"dequeue cancelled after {n} turns")
        with pytest.raises(asyncio.CancelledError):
            task.result()
        await until(lambda q=q: _no_waiter(q), what=f"the waiter withdrawn ({n} turns)")
        left = await drained(q, kind)
        assert left == ([7] if kind == "shuffle" else []), f"after {n} turns"


@pytest.mark.parametrize("kind", ["fifo", "shuffle", "padding"])
async def test_a_dequeue_cancelled_as_it_is_woken_loses_nothing(make_client, kind):
    """The cancellation lands while another client's enqueue wakes the dequeue: the
    element is either delivered (the task returns it) or still in the queue, never
    both, never neither; and the task ends promptly either way."""
    client, other = await make_client(), await make_client()
    for n in TURNS:
        name = f"race-{kind}-{n}"
        q, feeder = make(kind, client, name), make(kind, other, name)
        if kind == "shuffle":
            await q.enqueue(element(kind, 7))
        task = asyncio.ensure_future(q.dequeue())
        await until(lambda q=q: _waiting(q), what=f"the dequeue waiting ({n} turns)")
        put = asyncio.ensure_future(feeder.enqueue(element(kind, 100 + n)))
        await turns(n)
        task.cancel()
        await ended(task, f"dequeue cancelled {n} turns into a wake-up")
        await put
        got = [] if task.cancelled() else value(kind, task.result())
        left = await drained(q, kind)
        want = [100 + n] + ([7] if kind == "shuffle" else [])
        assert sorted(got + left) == sorted(want), f"{n} turns: got {got}, left {left}"


async def test_a_dequeue_many_holding_elements_gives_them_back(client):
    """dequeue_many(3) holds the two elements there are while it waits for a third; a
    cancellation at any point puts both back, in order."""
    for n in TURNS:
        q = make("fifo", client, f"held-{n}")
        await q.enqueue_many(np.array([1, 2], I64))
        task = asyncio.ensure_future(q.dequeue_many(3))
        await turns(n)
        task.cancel()
        await ended(task, f"dequeue_many cancelled after {n} turns")
        await until(lambda q=q: _no_waiter(q), what=f"the waiter withdrawn ({n} turns)")
        assert await drained(q, "fifo") == [1, 2], f"after {n} turns"


async def _no_waiter(q: Any) -> bool:
    return (await q.stats()).pending_dequeues == 0


async def _waiting(q: Any) -> bool:
    return (await q.stats()).pending_dequeues == 1
