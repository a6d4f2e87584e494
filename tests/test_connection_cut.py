"""A client's connections cut by the network: a TCP proxy between a client and a real
server resets every connection at once (an RST on both sides, as a dropped link or a
NAT that forgot the flow would), and keeps accepting new ones.

* connections that sat idle when they were cut are replaced before their next use: the
  next call succeeds (nothing had been sent on them, so nothing is sent twice);
* a call in the middle of its exchange raises ``UnavailableError`` at once, and a
  queue attempt that was waiting is withdrawn: what comes later goes to a live caller,
  not into the dead wait.

The chaos run (bench/chaos.py, docs/reliability.md) cuts a PS job's connections the
same way. Real server only: fakeredis has no sockets to cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest

from qps import resp, transport
from qps.embedded import find_server_binary
from qps.errors import DeadlineExceededError, UnavailableError
from qps.queues import FIFOQueue
from tests.conftest import blocked_clients, until, until_blocked

C = "cut"


class CutProxy:
    """Copies bytes both ways between each accepted connection and the server;
    :meth:`cut` resets every proxied connection."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        u = urlparse(upstream)
        self.unix = u.path if u.scheme == "unix" else None
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.db = u.path.lstrip("/") if u.scheme != "unix" else "0"
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/{self.db or 0}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.unix is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self.unix)
        else:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        pair = (writer, up_writer)
        self.pairs.add(pair)
        pumps = [asyncio.ensure_future(self._pump(reader, up_writer, pair)),
                 asyncio.ensure_future(self._pump(up_reader, writer, pair))]  # fmt: skip
        self.tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self.tasks.difference_update(pumps)
        self.pairs.discard(pair)

    @staticmethod
    async def _pump(
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        for w in pair:
            w.close()

    def cut(self) -> int:
        pairs, self.pairs = list(self.pairs), set()
        for pair in pairs:
            for w in pair:
                sock = w.get_extra_info("socket")
                if sock is not None and sock.family != socket.AF_UNIX:
                    with contextlib.suppress(OSError):  # closed already
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                w.transport.abort()
        return len(pairs)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def proxy(request: pytest.FixtureRequest) -> AsyncIterator[CutProxy]:
    url = os.environ.get("QPS_TEST_REDIS_URL")
    if url is None:
        try:
            find_server_binary()
        except UnavailableError as exc:
            pytest.skip(f"needs a real server: {exc}")
    else:
        u = urlparse(url)
        if u.scheme not in ("unix", "redis") or u.password or u.username or u.query:
            pytest.skip("the proxy takes a plain redis:// or unix:// server URL")
    url = request.getfixturevalue("server_url")
    async with transport.connected(url) as direct:
        await direct.commands.flushall()
    p = CutProxy(url)
    await p.start()
    try:
        yield p
    finally:
        await p.close()


def _connections(*clients: transport.Client) -> list[Any]:
    """Every connection ``clients`` hold now: their lean ones (scripts, waits, bulk
    reads) and those of their two redis-py pools, idle or in use."""
    conns: list[Any] = []
    for c in clients:
        conns += [x for x in (c._lean, *c._idle, *c._busy, *c._bulk) if x is not None]
        for r in (c.commands, c.blocking):
            pool = r.connection_pool
            conns += [*pool._available_connections, *pool._in_use_connections]
    return conns


def _known_dead(conn: Any) -> bool:
    """Whether the client has taken in the reset of ``conn``: what it checks before it
    uses a connection again (a lean one is closed; a pooled redis-py one's stream holds
    the error, see transport._Pool, or is at its end, or it never connected)."""
    if isinstance(conn, (resp.Connection, resp.BulkReader)):
        return conn.closed
    reader = getattr(conn, "_reader", None)
    return reader is None or reader.exception() is not None or reader.at_eof()


def _cut(proxy: CutProxy, *clients: transport.Client) -> tuple[int, list[Any]]:
    """Cut every proxied connection; return how many, and the connections ``clients``
    held then (for :func:`_taken_in`)."""
    held = _connections(*clients)
    return proxy.cut(), held


async def _taken_in(held: list[Any]) -> None:
    """Wait until the clients have taken in the reset of each connection of ``held``:
    the RSTs arrive at once on loopback, but only the clients' event loop turns them
    into connections known dead."""

    async def all_known_dead() -> bool:
        return all(_known_dead(x) for x in held)

    await until(all_known_dead, what="the clients took in the resets of their connections")


async def _none_blocked(direct: transport.Client) -> None:
    """Wait until the server holds no client blocked (a cut wait is let go of too)."""

    async def none() -> bool:
        return await blocked_clients(direct) == 0

    await until(none, what="no client blocked on the server")


async def test_connections_cut_while_idle_are_replaced(proxy: CutProxy) -> None:
    async with transport.connected(proxy.url) as c:
        q = FIFOQueue(4, np.int64, shared_name="q", container=C, client=c)
        # use every kind of connection once: the scripts' lean one, a waiter, both
        # redis-py pools
        await q.enqueue(np.int64(1))
        assert int(await q.dequeue(timeout=5)) == 1
        with pytest.raises(DeadlineExceededError):
            await q.dequeue(timeout=0.2)  # empty: a wait
        assert await q.size() == 0
        with transport.map_errors():
            assert await c.blocking.ping()
        n, held = _cut(proxy, c)
        assert n >= 4
        await _taken_in(held)
        # each succeeds the first time: a connection known dead is not used
        assert await c.ping()  # redis-py's command pool
        assert await q.size() == 0
        with transport.map_errors():
            assert await c.blocking.ping()
        await q.enqueue(np.int64(2))  # the lean script connection
        assert int(await q.dequeue(timeout=5)) == 2  # a waiter


async def test_a_wait_cut_in_its_middle_fails_and_is_withdrawn(proxy: CutProxy) -> None:
    async with (
        transport.connected(proxy.url) as c,
        transport.connected(proxy.url) as other,
        transport.connected(proxy.upstream) as direct,  # not through the proxy: never cut
    ):
        q = FIFOQueue(1, np.int64, shared_name="q", container=C, client=c)
        q2 = FIFOQueue(1, np.int64, shared_name="q", container=C, client=other)
        await _none_blocked(direct)
        waiting = asyncio.ensure_future(q.dequeue())  # an empty queue: it waits
        await until_blocked(direct, task=waiting, what="the dequeue blocked in BLPOP")
        _, held = _cut(proxy, c, other)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(waiting, 5)
        await _taken_in(held)
        await q2.enqueue(np.int64(7))
        assert int(await q2.dequeue(timeout=5)) == 7  # not handed to the dead wait

        # an enqueue waiting on a full queue: withdrawn, its element never stored
        await q2.enqueue(np.int64(8))
        await _none_blocked(direct)  # the server let go of the cut wait
        blocked = asyncio.ensure_future(q.enqueue(np.int64(9)))
        await until_blocked(direct, task=blocked, what="the enqueue blocked in BLPOP")
        _, held = _cut(proxy, c, other)
        with pytest.raises(UnavailableError):
            await asyncio.wait_for(blocked, 5)
        await _taken_in(held)
        assert int(await q2.dequeue(timeout=5)) == 8
        with pytest.raises(DeadlineExceededError):
            await q2.dequeue(timeout=0.5)  # 9 never landed
