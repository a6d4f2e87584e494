"""Small asyncio helpers that keep a task's cancellation.

``asyncio.wait_for`` before Python 3.12 can lose a cancellation: when the awaited
future finishes (or its timeout fires) in the same loop iteration as the task is
cancelled, it returns (or raises TimeoutError) and the ``CancelledError`` never reaches
the task (CPython gh-86296). A task that swallowed its cancellation runs on, and
whoever cancelled it and awaits it waits forever. The helpers here wait with
``asyncio.wait`` instead, which lets a cancellation through.
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


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
