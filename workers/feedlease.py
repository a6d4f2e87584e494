"""The feeder's lease on the feed into one queue: one feeder at a time runs a feed.

The lease is a key holding its feeder's owner string (:func:`qps.owners.default_owner`)
with a time to live of :data:`FEED_LEASE_MS`, renewed in the background and before each
chunk. Another feeder waits for it, blocked in Redis on a wake list that a release
pushes to, or takes it over at once from a dead process of this host: a
:class:`qps.lease.Lease`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from qps import keys
from qps.aio import unless_stopped
from qps.errors import AbortedError, QpsError
from qps.lease import Lease
from qps.transport import Client
from workers.input import Coordinator

__all__ = ["FEED_LEASE_MS", "FeedLease", "until_stop"]

log = logging.getLogger("qps.feed")

T = TypeVar("T")

#: How long a feeder's lease on its feed lasts unless renewed (a third of it).
FEED_LEASE_MS = 10_000


async def until_stop(aw: Awaitable[T], coord: Coordinator) -> tuple[bool, T | None]:
    """Await ``aw`` unless a stop is requested first; then cancel it. Returns
    ``(finished, result)``; ``aw``'s exception, if it failed, is raised."""
    run = await unless_stopped(aw, coord.stop_event)
    return (False, None) if run.cancelled() else (True, run.result())


class FeedLease:
    """The feeder's lease on the feed into one queue: one feeder at a time feeds it."""

    def __init__(self, client: Client, container: str, queue: str, owner: str) -> None:
        prefix = keys.feed_prefix(container, queue)
        self.lease = Lease(client, prefix + "owner", owner, FEED_LEASE_MS, prefix + "wake")
        self.queue = queue
        self.lost: str | None = None  # who took it from us

    async def acquire(self, coord: Coordinator) -> bool:
        """Take the lease, taking it over at once from a dead process of this host,
        else waiting (blocked in Redis) until it is released or runs out; False if a stop
        is requested first."""
        announced = False
        while not coord.should_stop():
            held = await self.lease.take()
            if held is None:
                return True
            if self.lease.dead(held):
                if await self.lease.take(replace=held.value) is None:
                    log.info(
                        "took over the feed into '%s' from %s, a dead process",
                        self.queue, held.value,
                    )  # fmt: skip
                    return True
                continue
            if not announced:
                log.info(
                    "the feed into '%s' is run by %s: waiting until it ends or its lease "
                    "(%d ms left) runs out",
                    self.queue, held.value, held.pttl,
                )  # fmt: skip
                announced = True
            await self.lease.wait(held, coord.stop_event)
        return False

    async def check(self) -> None:
        """Renew the lease; raises AbortedError if another feeder took it."""
        if self.lost is None:
            holder = await self.lease.renew()
            if holder is not None:
                self.lost = holder or "nobody (it ran out)"
        if self.lost is not None:
            raise AbortedError(
                f"the feed into '{self.queue}' was taken over by {self.lost} while this "
                "feeder stalled: stopping (the new feeder goes on where it is)"
            )

    async def renew_loop(self) -> None:
        while True:
            await asyncio.sleep(FEED_LEASE_MS / 3000.0)
            try:
                await self.check()
            except AbortedError as exc:
                log.error("%s", exc)
                return
            except QpsError as exc:
                log.warning("could not renew the feed lease: %s", exc)

    async def release(self) -> None:
        with contextlib.suppress(QpsError):
            await self.lease.release()
