"""A PS shard's lease: ``qps:{C/ps/i}:lease`` (``SET NX PX``, value ``"<token>
<owner>"``) with a fresh fencing token from the container counter ``ps/token`` (``INCR``:
every lease gets a larger one). While another copy holds it, a standby blocks in
``BLPOP`` on ``qps:{C/ps/i}:wake`` (pushed when a holder releases), never polling; a
holder that is a dead process of this host is taken over at once. The holder renews it
every third of its length (:meth:`ShardLease.renew`, called by the shard's renewal
loop). It is a :class:`qps.lease.Lease` whose value carries the fencing token."""

from __future__ import annotations

import asyncio
import logging

from qps import keys, varcheck
from qps.containers import Counter
from qps.errors import FailedPreconditionError
from qps.lease import Lease
from qps.owners import owner_is_dead
from qps.ps.status import check_lease
from qps.transport import Client

__all__ = ["LeaseLostError", "ShardLease", "dead_holder"]


class LeaseLostError(FailedPreconditionError):
    """The shard lost its lease (it stalled past it, or another copy took over and
    fenced its variables): it stops writing and exits."""


def _owner(value: str) -> str:
    """The owner in a lease value ``<token> <owner>`` ('' if it has none)."""
    parts = value.split(" ", 1)
    return parts[1] if len(parts) == 2 else ""


def dead_holder(value: str) -> bool:
    """Whether the lease value ``value`` (``<token> <owner>``) names a shard process of
    this host and PID namespace that no longer exists: its lease can be taken over at
    once instead of waiting for it to expire (see :func:`qps.owners.owner_is_dead`)."""
    return owner_is_dead(_owner(value))


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
        self.log = log
        prefix = keys.ps_prefix(container, shard)
        self.key = prefix + "lease"
        self._lease = Lease(client, self.key, "", ms, prefix + "wake", _owner)
        self.token = 0
        self.takeover: str | None = None

    @property
    def value(self) -> str:
        """``"<token> <owner>"`` once taken."""
        return self._lease.value

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Take the lease (waiting as a standby while another copy holds it); False if
        ``stop`` was set first."""
        tokens = Counter(keys.PS_TOKEN_COUNTER, container=self.container, client=self.client)
        announced = False
        while not stop.is_set():
            token = await tokens.add(1)  # each try a larger one: the value is ours alone
            self._lease.value = f"{token} {self.owner}"
            with varcheck.naming(self.key):
                held = await self._lease.take()
            if held is None:
                self.token = token
                self.log.info("lease taken with fencing token %d (owner %s)", token, self.owner)
                return True
            check_lease(held.value, self.key, held.pttl)  # a corrupt one never runs out
            if self._lease.dead(held):
                # a crashed copy on this machine (a restart after SIGKILL): do not wait
                # out its lease. Its token is lower than ours, so its variables are
                # fenced against it in any case; the script checks it still holds it.
                if await self._lease.take(replace=held.value) is None:
                    self.token, self.takeover = token, held.value
                    self.log.info(
                        "lease taken over from %s, a dead process of this host (%d ms of "
                        "its lease left), with fencing token %d",
                        held.value, held.pttl, token,
                    )  # fmt: skip
                    return True
                continue
            if not announced:
                self.log.info("shard is held by %s: waiting as a standby", held.value)
                announced = True
            await self._lease.wait(held, stop)
        return False

    async def renew(self) -> str | None:
        """Extend the lease; None if it took, else the value now held ('' if none).

        Raises:
            QpsError: Redis failed (the lease may still be ours: try again).
        """
        with varcheck.naming(self.key):
            return await self._lease.renew()

    async def release(self) -> None:
        """Give the lease up (if still ours) and wake a standby."""
        with varcheck.naming(self.key):
            await self._lease.release()
