"""qps.aio.wait_event: a cancellation of the waiting task is never lost, whenever it
comes relative to the event (asyncio.wait_for before 3.12 loses one that comes just
after the event is set, and a shard task that lost its cancellation never ended).
qps.aio.shielded: a shielded call that fails after its caller was cancelled leaves no
"Task exception was never retrieved" behind."""

from __future__ import annotations

import asyncio
import gc

import pytest

from qps.aio import bounded, shielded, unless_stopped, wait_event


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


@pytest.mark.parametrize("shield", ["asyncio.shield", "qps.aio.shielded"])
async def test_a_shielded_call_that_fails_after_its_caller_is_cancelled(shield: str) -> None:
    """The caller is cancelled (a shard's fetcher as the shard stops), then the
    shielded call fails (Redis gone): asyncio.shield leaves its failure unretrieved
    (reported with a traceback when the task is collected); shielded retrieves it."""
    reported: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    fail = asyncio.Event()

    async def call() -> None:  # a Redis call that fails once its caller gave up
        await fail.wait()
        raise ConnectionError("Redis gone")

    async def caller() -> None:
        if shield == "asyncio.shield":
            await asyncio.shield(call())
        else:
            await shielded(call())

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)  # it awaits the call
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fail.set()
    for _ in range(3):  # the call fails, its task ends
        await asyncio.sleep(0)
    del task
    gc.collect()  # an unretrieved failure is reported as its task is collected
    never = [c for c in reported if "never retrieved" in str(c.get("message"))]
    loop.set_exception_handler(None)
    assert bool(never) == (shield == "asyncio.shield"), reported


async def test_shielded_passes_the_result_and_the_failure_through() -> None:
    async def value() -> int:
        return 7

    async def failure() -> None:
        raise ValueError("no")

    assert await shielded(value()) == 7
    with pytest.raises(ValueError, match="no"):
        await shielded(failure())


async def test_bounded_and_unless_stopped_leave_nothing_running() -> None:
    """qps.aio.bounded gives the call's outcome, or cancels it when its time is up;
    both it and unless_stopped cancel the call when their caller is cancelled."""
    never = asyncio.Event()
    assert (await bounded(asyncio.sleep(0, "done"), 5)).result() == "done"
    assert (await bounded(never.wait(), 0.01)).cancelled()  # out of time
    for helper in (lambda: bounded(never.wait(), 60), lambda: unless_stopped(never.wait(), never)):
        caller = asyncio.create_task(helper())
        for _ in range(3):  # loop turns: the caller is inside its wait
            await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not asyncio.all_tasks() - {asyncio.current_task()}  # the call went too
