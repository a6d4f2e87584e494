"""qps.aio.wait_event: a cancellation of the waiting task is never lost, whenever it
comes relative to the event (asyncio.wait_for before 3.12 loses one that comes just
after the event is set, and a shard task that lost its cancellation never ended)."""

from __future__ import annotations

import asyncio

import pytest

from qps.aio import wait_event


async def test_wait_event_returns_whether_the_event_is_set() -> None:
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    ev.set()
    assert await wait_event(ev, 0.01) is True
    assert await wait_event(ev, None) is True


@pytest.mark.parametrize("turns", range(4))
async def test_a_cancellation_right_after_the_event_is_kept(turns: int) -> None:
    ev = asyncio.Event()
    task = asyncio.create_task(wait_event(ev, 5))
    # loop turns, not time, are under test: the cancellation comes `turns` turns after
    # the event is set (no I/O: each sleep(0) is exactly one turn)
    await asyncio.sleep(0)  # the task waits
    ev.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.cancel():  # not finished yet: the cancellation must reach it
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert task.result() is True
    assert not asyncio.all_tasks() - {asyncio.current_task()}  # no waiter left behind
