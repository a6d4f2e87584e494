"""Leases and blocked callers: how long a silent caller is trusted, the registry of a
client's blocked attempts (closing the client wakes them), and the process-wide client."""

from __future__ import annotations

import asyncio
import logging
import os

from qps.aio import wait_event
from qps.transport import BLOCK_SECONDS, Client, connect

log = logging.getLogger("qps.queue")

#: A blocked caller renews its attempt's lease on every wait (each BLOCK_SECONDS); a
#: caller silent for this long is taken for dead and its attempt is undone. Set by
#: ``QPS_LEASE_MS`` (at least 3 x BLOCK_SECONDS, so that a live caller never expires).
LEASE_MS = max(int(os.environ.get("QPS_LEASE_MS", "10000")), int(3000 * BLOCK_SECONDS))


class Waiters:
    """The attempts of one client that are blocked right now, so that closing the client
    can wake them with CancelledError (TF: Session.close cancels pending ops)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.blocked: dict[str, tuple[list[str], str, asyncio.Event]] = {}
        client.on_close(self.cancel_all)

    async def cancel_all(self) -> None:
        if _waiters.get(id(self.client)) is self:
            del _waiters[id(self.client)]
        for aid, (qkeys, entry, done) in list(self.blocked.items()):
            await self.client.run_script("abort", qkeys, [f"{LEASE_MS} {entry} {aid} kill"])
            if not await wait_event(done, BLOCK_SECONDS + 2):
                log.warning("blocked call %s did not finish after its client closed", aid)


_waiters: dict[int, Waiters] = {}


def waiters_of(client: Client) -> Waiters:
    w = _waiters.get(id(client))
    if w is None or w.client is not client:
        w = _waiters[id(client)] = Waiters(client)
    return w


_default_client: Client | None = None
_default_lock: asyncio.Lock | None = None


async def default_client() -> Client:
    """The process-wide client used by queues created without ``client=``.

    It connects to ``$QPS_REDIS_URL`` or the local embedded server (see
    :func:`qps.transport.connect`).
    """
    global _default_client, _default_lock
    if _default_client is not None and not _default_client.closed:
        return _default_client
    if _default_lock is None:
        _default_lock = asyncio.Lock()
    async with _default_lock:
        if _default_client is None or _default_client.closed:
            _default_client = await connect()
    return _default_client
