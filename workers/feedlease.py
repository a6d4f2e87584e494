"""The feeder's lease on the feed into one queue: one feeder at a time runs a feed.

The lease is a key holding its feeder's owner string (:func:`qps.owners.default_owner`)
with a time to live of :data:`FEED_LEASE_MS`, renewed in the background and before each
chunk. Another feeder waits for it, blocked in Redis on a wake list that a release
pushes to, or takes it over at once from a dead process of this host. Its script is
``qps/lua/workers/feed_lease.lua``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from qps import keys
from qps.errors import AbortedError, QpsError
from qps.owners import owner_is_dead
from qps.registry import text_of
from qps.transport import BLOCK_SECONDS, Client
from workers.input import Coordinator

__all__ = ["FEED_LEASE_MS", "FeedLease", "until_stop"]

log = logging.getLogger("qps.feed")

T = TypeVar("T")

#: How long a feeder's lease on its feed lasts unless renewed (a third of it).
FEED_LEASE_MS = 10_000


async def until_stop(aw: Awaitable[T], coord: Coordinator) -> tuple[bool, T | None]:
    """Await ``aw`` unless a stop is requested first; then cancel it. Returns
    ``(finished, result)``."""
    task = asyncio.ensure_future(aw)
    stopper = asyncio.ensure_future(coord.wait_for_stop())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


class FeedLease:
    """The feeder's lease on the feed into one queue: one feeder at a time feeds it."""

    def __init__(self, client: Client, container: str, queue: str, owner: str) -> None:
        prefix = keys.feed_prefix(container, queue)
        self.keys = [prefix + "owner", prefix + "wake"]
        self.client, self.owner, self.queue = client, owner, queue
        self.lost: str | None = None  # who took it from us

    async def _call(self, *args: Any) -> tuple[str, list[Any]]:
        """The script's status word and the rest of its reply."""
        reply = await self.client.run_script("workers/feed_lease", self.keys, list(args))
        return text_of(reply[0]), list(reply[1:])

    async def acquire(self, coord: Coordinator) -> bool:
        """Take the lease, taking it over at once from a dead process of this host,
        else waiting (blocked in Redis) until it is released or runs out; False if a stop
        is requested first."""
        announced = False
        while not coord.should_stop():
            status, rest = await self._call("take", self.owner, FEED_LEASE_MS)
            if status == "ok":
                return True
            held, pttl = text_of(rest[0]), int(rest[1])
            if owner_is_dead(held):
                status, _ = await self._call("takeover", self.owner, FEED_LEASE_MS, held)
                if status == "ok":
                    log.info(
                        "took over the feed into '%s' from %s, a dead process", self.queue, held
                    )
                    return True
                continue
            if not announced:
                log.info(
                    "the feed into '%s' is run by %s: waiting until it ends or its lease "
                    "(%d ms left) runs out",
                    self.queue,
                    held,
                    pttl,
                )
                announced = True
            wait = min(max(pttl, 10) / 1000.0, BLOCK_SECONDS)
            await until_stop(self.client.blocking.blpop([self.keys[1]], wait), coord)
        return False

    async def check(self) -> None:
        """Renew the lease; raises AbortedError if another feeder took it."""
        if self.lost is None:
            status, rest = await self._call("renew", self.owner, FEED_LEASE_MS)
            if status != "ok":
                self.lost = text_of(rest[0]) or "nobody (it ran out)"
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
            await self._call("release", self.owner, FEED_LEASE_MS)
