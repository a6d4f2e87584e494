"""Small asyncio helpers that keep a task's cancellation.

``asyncio.wait_for`` before Python 3.12 can lose a cancellation: when the awaited
future finishes (or its timeout fires) in the same loop iteration as the task is
cancelled, it returns (or raises TimeoutError) and the ``CancelledError`` never reaches
the task (CPython gh-86296). A task that swallowed its cancellation runs on, and
whoever cancelled it and awaits it waits forever. The helpers here wait with
``asyncio.wait`` instead, which lets a cancellation through.

``asyncio.shield(coro)`` has a trap of its own: when the caller is cancelled, the
shielded call runs on in a task nobody awaits, and should it fail (Redis gone, say),
asyncio reports ``Task exception was never retrieved`` with a traceback as the process
exits. :func:`shielded` retrieves that outcome.

``asyncio.to_thread`` runs on the loop's default executor, which ``asyncio.run`` joins
as it ends: a process stopped by a signal while a thread loads a dataset waits for the
load. :func:`in_daemon_thread` runs the call on a daemon thread nobody joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["bounded", "in_daemon_thread", "shielded", "unless_stopped", "wait_event"]

T = TypeVar("T")

log = logging.getLogger("qps.aio")


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass (None: no limit); return
    whether it is set. A cancellation of the caller is never lost."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()
    return event.is_set()


async def unless_stopped(aw: Awaitable[T], stop: asyncio.Event) -> asyncio.Future[T]:
    """Run ``aw`` until it ends or ``stop`` is set, whichever comes first; the other is
    cancelled and awaited. Returns ``aw``'s future: done (its result or exception, for
    the caller to read or leave) or cancelled (``stop`` came first). A cancellation of
    the caller cancels ``aw`` too."""
    run = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when the caller is cancelled: neither is left running
        stopped.cancel()
        if not run.done():
            run.cancel()
        await asyncio.gather(run, stopped, return_exceptions=True)
    return run


async def bounded(aw: Awaitable[T], seconds: float) -> asyncio.Future[T]:
    """Run ``aw`` for at most ``seconds``, then cancel it; returns its future, done (its
    result or exception, for the caller to read or leave) or cancelled (out of time). A
    cancellation of the caller cancels ``aw`` too."""
    run = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({run}, timeout=seconds)
    finally:
        if not run.done():
            run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    return run


async def shielded(aw: Awaitable[T]) -> T:
    """``await asyncio.shield(aw)``: a cancellation of the caller does not cancel
    ``aw``, which runs to its end. Should the caller be cancelled meanwhile, the outcome
    of ``aw`` is still retrieved when it ends (a failure logged at DEBUG), so that a
    call that fails after its caller gave up (Redis gone) leaves no ``Task exception
    was never retrieved`` behind."""
    inner = asyncio.ensure_future(aw)
    inner.add_done_callback(_retrieve)
    return await asyncio.shield(inner)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("a shielded call failed: %r", fut.exception())


def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
    """Start ``fn(*args, **kwargs)`` on a daemon thread of its own and return a future
    of its result (or its exception). Cancelling the future, or the loop's end, does not
    wait for the thread (unlike ``asyncio.to_thread``): a stopping process exits at once
    and the thread dies with it. For reads with no side effects only (a dataset's load).
    Called from a running loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)

    def run() -> None:
        try:
            value, exc = fn(*args, **kwargs), None
        except Exception as e:
            value, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, value, exc)

    name = f"qps-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return fut
