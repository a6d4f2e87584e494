"""A PS shard's lease: ``qps:{C/ps/i}:lease`` (``SET NX PX``, value ``"<token>
<owner>"``) with a fresh fencing token from the container counter ``ps/token`` (``INCR``:
every lease gets a larger one). While another copy holds it, a standby blocks in
``BLPOP`` on ``qps:{C/ps/i}:wake`` (pushed when a holder releases), never polling; a
holder that is a dead process of this host is taken over at once. The holder renews it
every third of its length (:meth:`ShardLease.renew`, called by the shard's renewal
loop). The script is ``qps/lua/ps/lease.lua``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from qps import keys, varcheck
from qps.aio import unless_stopped
from qps.containers import Counter
from qps.errors import FailedPreconditionError
from qps.owners import owner_is_dead
from qps.ps.status import check_lease
from qps.registry import text_of
from qps.transport import BLOCK_SECONDS, Client

__all__ = ["LeaseLostError", "ShardLease", "dead_holder"]


class LeaseLostError(FailedPreconditionError):
    """The shard lost its lease (it stalled past it, or another copy took over and
    fenced its variables): it stops writing and exits."""


def dead_holder(value: str) -> bool:
    """Whether the lease value ``value`` (``<token> <owner>``) names a shard process of
    this host and PID namespace that no longer exists: its lease can be taken over at
    once instead of waiting for it to expire (see :func:`qps.owners.owner_is_dead`)."""
    parts = value.split(" ", 1)
    return len(parts) == 2 and owner_is_dead(parts[1])


class ShardLease:
    """The lease of shard ``shard`` of ``container``, taken by ``owner`` for ``ms``
    milliseconds at a time. ``token`` and ``value`` are set once :meth:`acquire` took
    it; ``takeover`` is the value of a dead holder it was taken over from, or None."""

    def __init__(
        self,
        client: Client,
        container: str,
        shard: int,
        owner: str,
        ms: int,
        log: logging.LoggerAdapter,  # type: ignore[type-arg]
    ) -> None:
        self.client = client
        self.container = container
        self.owner = owner
        self.ms = ms
        self.log = log
        prefix = keys.ps_prefix(container, shard)
        self.key = prefix + "lease"
        self._keys = [self.key, prefix + "wake"]
        self.token = 0
        self.value = ""
        self.takeover: str | None = None

    async def _script(self, *args: Any) -> Any:
        with varcheck.naming(self.key):
            return await self.client.run_script("ps/lease", self._keys, args)

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Take the lease (waiting as a standby while another copy holds it); False if
        ``stop`` was set first."""
        tokens = Counter(keys.PS_TOKEN_COUNTER, container=self.container, client=self.client)
        announced = False
        while not stop.is_set():
            token = await tokens.add(1)
            value = f"{token} {self.owner}"
            reply = await self._script("acquire", value, self.ms)
            if reply[0] == b"ok":
                self.token, self.value = token, value
                self.log.info("lease taken with fencing token %d (owner %s)", token, self.owner)
                return True
            pttl = int(reply[1])
            held = text_of(reply[2] or b"")
            check_lease(held, self.key, pttl)  # a corrupt one never runs out
            if dead_holder(held):
                # a crashed copy on this machine (a restart after SIGKILL): do not wait
                # out its lease. Its token is lower than ours, so its variables are
                # fenced against it in any case; the script checks it still holds it.
                took = await self._script("takeover", value, self.ms, held)
                if took[0] == b"ok":
                    self.token, self.value, self.takeover = token, value, held
                    self.log.info(
                        "lease taken over from %s, a dead process of this host (%d ms of "
                        "its lease left), with fencing token %d",
                        held, pttl, token,
                    )  # fmt: skip
                    return True
                continue
            if not announced:
                self.log.info("shard is held by %s: waiting as a standby", held or "?")
                announced = True
            await self._standby(stop, min(max(pttl, 10) / 1000.0, BLOCK_SECONDS))
        return False

    async def _standby(self, stop: asyncio.Event, wait: float) -> None:
        """Block on the wake list for up to ``wait`` s, or until ``stop`` is set."""
        await unless_stopped(self.client.blocking.blpop([self._keys[1]], wait), stop)

    async def renew(self) -> str | None:
        """Extend the lease; None if it took, else the value now held ('' if none).

        Raises:
            QpsError: Redis failed (the lease may still be ours: try again).
        """
        reply = await self._script("renew", self.value, self.ms)
        return None if reply[0] == b"ok" else text_of(reply[1])

    async def release(self) -> None:
        """Give the lease up (if still ours) and wake a standby."""
        await self._script("release", self.value, 0)
