"""Leases: a Redis key that one holder at a time owns, with a time to live the holder
renews (a third of it at a time). A PS shard leases its shard (:mod:`qps.ps.lease`,
with a fencing token), a feeder the feed into a queue (:mod:`workers.feedlease`), a
launcher its container (:mod:`workers.lifecycle`). One script, ``qps/lua/leases/lease.lua``,
takes, renews and releases them.

A taker that finds the lease held either takes it over at once, when its holder is a
dead process of this host (:func:`qps.owners.owner_is_dead` of the owner in the value),
or waits blocked in Redis on the lease's wake list, which a release pushes to, for at
most the lease's remaining time: no polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qps.aio import unless_stopped
from qps.owners import owner_is_dead
from qps.registry import text_of
from qps.transport import BLOCK_SECONDS, Client

__all__ = ["Held", "Lease"]


@dataclass(frozen=True)
class Held:
    """Another holder's lease: its value and its remaining time to live (ms; -1: none)."""

    value: str
    pttl: int


class Lease:
    """The lease ``key`` held with ``value`` for ``ms`` milliseconds at a time; ``wake``
    is the list a waiting taker blocks on (None: nobody waits, :meth:`take` only).
    ``owner_of`` extracts the owner string from a holder's value (for the dead-holder
    takeover)."""

    def __init__(
        self,
        client: Client,
        key: str,
        value: str,
        ms: int,
        wake: str | None = None,
        owner_of: Callable[[str], str] = lambda value: value,
    ) -> None:
        self.client, self.key, self.value, self.ms = client, key, value, ms
        self._keys = [key] if wake is None else [key, wake]
        self._owner_of = owner_of

    async def _call(self, op: str, replace: str = "") -> list[Any]:
        return list(
            await self.client.run_script(
                "leases/lease", self._keys, [op, self.value, self.ms, replace]
            )
        )

    async def take(self, replace: str = "") -> Held | None:
        """Take the lease if it is free, ours, or held by ``replace``; None if taken,
        else who holds it."""
        reply = await self._call("take", replace)
        if reply[0] == b"ok":
            return None
        return Held(text_of(reply[1]), int(reply[2]))

    def dead(self, held: Held) -> bool:
        """Whether ``held`` is a dead process of this host (its lease can be taken over
        at once instead of waited out)."""
        return owner_is_dead(self._owner_of(held.value))

    async def wait(self, held: Held, stop: asyncio.Event) -> None:
        """Block until the lease is released or its remaining time has passed (at most
        :data:`~qps.transport.BLOCK_SECONDS`), or ``stop`` is set."""
        seconds = min(max(held.pttl, 10) / 1000.0, BLOCK_SECONDS)
        await unless_stopped(self.client.blpop([self._keys[1]], seconds), stop)

    async def renew(self) -> str | None:
        """Extend the lease; None if it is still ours, else the value now held ('' if
        none)."""
        reply = await self._call("renew")
        return None if reply[0] == b"ok" else text_of(reply[1])

    async def release(self) -> bool:
        """Delete the lease if it is still ours and wake one waiting taker; whether it
        was ours."""
        return bool((await self._call("release"))[0] == b"ok")
